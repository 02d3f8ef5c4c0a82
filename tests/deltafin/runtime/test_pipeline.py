"""In-process stages are planned once: pipeline.plan_stages makes each stage's plan before any weights load, and each
stage loads the plan it is handed, sizing nothing again."""

from __future__ import annotations

import torch

from deltafin.checkpoint.config import load_config
from deltafin.plan import sizing
from deltafin.runtime import stage_build
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage import SeqInput
from deltafin.runtime.stage_options import StageOptions


def test_each_in_process_stage_is_planned_once(tiny_dir, monkeypatch):
    calls = []
    choose = sizing.choose

    def counted(cfg, start, end, *args, **kwargs):
        calls.append((start, end))
        return choose(cfg, start, end, *args, **kwargs)

    monkeypatch.setattr(stage_build, "choose", counted)
    cfg = load_config(tiny_dir)
    options = StageOptions(memory_bytes=2 * 10**9).replace(context=512)  # a context given: nothing to share
    pipe = LocalPipeline.load(tiny_dir, 2, device="cpu", options=options)
    try:
        assert sorted(calls) == [(0, 3), (3, cfg.num_layers)]  # one plan a stage, none made again as they load
        assert [s.sizing.context for s in pipe.stages] == [512, 512]
        logits = pipe.forward([SeqInput("s", 0, ids=torch.tensor([1, 2, 3]))])[0].logits
        assert logits is not None and torch.isfinite(logits).all()
    finally:
        pipe.close()

