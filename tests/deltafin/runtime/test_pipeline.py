"""In-process stages are planned once: pipeline.plan_stages makes each stage's plan before any weights load, and each
stage loads the plan it is handed, sizing nothing again."""

from __future__ import annotations

import torch

from deltafin.checkpoint.config import load_config
from deltafin.plan.memory import sizing
from deltafin.runtime import stage_build
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
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
        assert [s.plan.context for s in pipe.stages] == [512, 512]
        logits = pipe.forward([SeqInput("s", 0, ids=torch.tensor([1, 2, 3]))])[0].logits
        assert logits is not None and torch.isfinite(logits).all()
    finally:
        pipe.close()



def test_prompts_in_one_forward_read_each_expert_once(tiny_dir):
    """Two prompts prefilling in one forward (the scheduler batches them: coordinator/engine/scheduler.py) read each
    expert a layer touches once for both, where one after the other they read every expert twice; their logits are
    each prompt's own (summed by expert over both prompts' rows rather than by slot: within rounding)."""
    cfg = load_config(tiny_dir)
    gen = torch.Generator().manual_seed(11)
    a, b = (torch.randint(0, 1000, (300,), generator=gen) for _ in range(2))
    options = StageOptions().replace(expert_cache_bytes=0, read_threads=2)

    def reads(pipe: LocalPipeline) -> int:
        # demand reads and guesses alike
        return sum(e.reads for s in pipe.stages if (e := s.stats().experts) is not None)

    together = LocalPipeline.load(tiny_dir, 1, device="cpu", options=options)
    apart = LocalPipeline.load(tiny_dir, 1, device="cpu", options=options)
    try:
        both = together.forward([SeqInput("a", 0, ids=a), SeqInput("b", 0, ids=b)])
        one = [apart.forward([SeqInput(s, 0, ids=ids)])[0] for s, ids in (("a", a), ("b", b))]
        touched = len(cfg.moe_layers) * cfg.num_experts  # 300 tokens touch every expert of a tiny layer
        assert reads(together) == touched and reads(apart) == 2 * touched
        for x, y in zip(both, one, strict=True):
            assert ((x.logits - y.logits).norm() / y.logits.norm()) < 1e-5  # fp32 sums in another order
    finally:
        together.close()
        apart.close()
