"""What a worker takes: an assignment whose plan holds the spine in another format than the worker was started
with is refused with the reason, never silently run in the plan's format; the plan a worker is sent is the plan it
loads (checked, never made again), and one that would place otherwise here is loaded as placed here."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import fingerprint, open_checkpoint
from deltafin.errors import NotAssigned
from deltafin.plan.memory.sizing_options import SizingOptions
from deltafin.runtime.stage_options import StageOptions
from deltafin.transport import codec
from deltafin.transport.worker_info import WorkerDescription
from deltafin.worker.assignment import AssignmentSlot, check_assignment
from tests.support.plans import assignment, stage_plan


def test_a_worker_s_own_spine_is_honoured_or_the_assignment_refused(tiny_dir):
    cfg = load_config(tiny_dir)
    me = WorkerDescription("w", "", "cpu", 1, 1.0, fingerprint(tiny_dir), ((0, 6),), True, spine="q4")
    own = StageOptions(sizing=SizingOptions(spine="q4"))
    request = assignment(tiny_dir, fingerprint(tiny_dir), 0, 6, spine="q4")
    _, sizing, _ = check_assignment(request, me, cfg, own)
    assert sizing is not None and sizing.spine == "q4"
    int8 = assignment(tiny_dir, fingerprint(tiny_dir), 0, 6, spine="int8")
    with pytest.raises(NotAssigned, match=r"started with --spine q4, and the plan holds the spine as int8"):
        check_assignment(int8, me, cfg, own)
    _, sizing, _ = check_assignment(int8, me, cfg, StageOptions())  # its own: auto
    assert sizing is not None and sizing.spine == "int8"


def test_the_plan_sent_is_the_plan_loaded(tiny_dir, monkeypatch, caplog):
    """The worker sizes nothing again: the stage it loads holds exactly the plan it was sent (every part, the
    resident layers, the cache), and sizing.choose is never called on the way. A plan that counted a part otherwise
    than this worker places it (here: a workspace of 1 byte) is loaded as placed here, with a warning naming it."""
    cfg = load_config(tiny_dir)
    sent = codec.decode_stage_plan(stage_plan(tiny_dir, 0, 6, max_resident_layers=2, expert_cache_bytes=300_000,
                                              sequences=2), cfg.num_layers)
    assert sent.resident_layers == (0, 1) and sent.streamed_layers == (2, 3, 4, 5) and sent.sequences == 2

    def no_planning(*args, **kwargs):
        raise AssertionError("the worker planned the stage again")

    monkeypatch.setattr("deltafin.plan.memory.sizing.choose", no_planning)
    monkeypatch.setattr("deltafin.runtime.stage_build.choose", no_planning)
    slot = AssignmentSlot(open_checkpoint(tiny_dir, cfg), torch.device("cpu"), lambda: "w")
    options = StageOptions(memory_bytes=4 * 10**9)
    try:
        loaded = slot.check_fits(0, 6, options, sent)
        assert loaded == sent
        assigned = slot.load(None, 0, 6, options, loaded, None, {}, lambda *_: None)
        assert assigned.plan == sent and assigned.stage is not None and assigned.stage.plan == sent
        assigned.close()
        odd = dataclasses.replace(sent, workspace=1)
        with caplog.at_level(logging.WARNING):
            assert slot.check_fits(0, 6, options, odd) == sent
        assert "workspace 1 (here " in caplog.text
    finally:
        slot.close()
