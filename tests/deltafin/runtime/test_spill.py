"""A prompt longer than the forward the memory holds goes in one forward with its rows' AttnRes blocks on the disk
(runtime/spill.py, plan/memory/spill_cost.py): it computes what a stage holding every row's state in memory computes,
bit for bit, its next steps too (the sessions' caches are the same); it reads and writes what the plan prices and each
expert once; it leaves nothing on the disk; and a disk without the room refuses it before any session changes."""

from __future__ import annotations

import dataclasses
import os
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import open_checkpoint
from deltafin.errors import DeltafinError
from deltafin.mini.synth import synthesize
from deltafin.plan.memory.sizing import Placement, lent, size_stage
from deltafin.plan.memory.spill_cost import spill_read_bytes, spill_write_bytes
from deltafin.plan.memory.stage_parts import expert_slot_bytes
from deltafin.plan.memory.stage_plan import Budget
from deltafin.runtime import spill as spill_mod
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage import Stage
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import StageOptions
from deltafin.weights.reader import layer_spans

CPU = torch.device("cpu")
PROMPT_FORWARD, SPILLED = 600, 1400  # a prompt's forward in memory, and spilled (three attention pieces of 512)
Usage = namedtuple("Usage", "total used free")  # shutil.disk_usage's answer


@pytest.fixture(scope="module", params=["tiny", "odd"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny, and odd (sizes no power of two: the rows' byte offsets in the file are no round numbers)."""
    return synthesize(request.param, tmp_path_factory.mktemp(request.param), seed=0, show_progress=False)


def _spilling_stage(model: Path, spill_dir: Path, cache_experts: int | None) -> Stage:
    """A stage of every layer planned to spill prompts of more than PROMPT_FORWARD tokens, up to SPILLED: its experts
    resident (`cache_experts` None), or streamed as `_spill` plans it, with forwards of 512 beside a cache of that
    many experts, lent to prompts, in a budget that holds the plan and both kinds of prompt forward."""
    cfg = load_config(model)
    ckpt = open_checkpoint(model, cfg)
    options = StageOptions(spill_dir=str(spill_dir))
    inputs = dataclasses.replace(options.sizing_for(ckpt.config, layer_spans(ckpt)), spine="bf16", prefill_chunk=512,
                                 prompt_tokens=PROMPT_FORWARD, spill_tokens=SPILLED, context=4096)
    place = Placement("cpu")
    cache = None if cache_experts is None else cache_experts * expert_slot_bytes(cfg)
    plan = size_stage(cfg, 0, cfg.num_layers, place, "bf16", cache, cfg.num_layers, inputs)
    assert (plan.prompt_tokens, plan.spill_tokens) == (PROMPT_FORWARD, SPILLED)
    during = [lent(cfg, plan, place, inputs, PROMPT_FORWARD), lent(cfg, plan, place, inputs, SPILLED, spilled=True)]
    assert during[1].workspace < lent(cfg, plan, place, inputs, SPILLED).workspace  # what spilling saves
    budget = max(plan.total, *(d.total for d in during))
    assert all(Budget(budget).fits(s) for s in (plan, *during))
    return Stage(ckpt, 0, cfg.num_layers, device=CPU, options=options.replace(memory_bytes=budget), plan=plan)


def _prompt(model: Path) -> torch.Tensor:
    return torch.randint(0, load_config(model).vocab_size, (SPILLED - 77,), generator=torch.Generator().manual_seed(3))


def test_a_spilled_prompt_is_bit_identical_and_moves_what_the_plan_prices(model: Path, tmp_path: Path) -> None:
    """Against the stage that holds every row (both with resident experts, whose sums add in one order)."""
    cfg, prompt = load_config(model), _prompt(model)
    held = LocalPipeline.load(model, 1, device="cpu")  # no budget: every row's state in memory
    stage = _spilling_stage(model, tmp_path / "spill", None)
    try:
        assert stage.max_forward_tokens == SPILLED  # what the coordinator cuts prompts to
        want = held.forward([SeqInput("h", 0, ids=prompt)])[0].logits
        assert torch.equal(stage.forward([SeqInput("s", 0, ids=prompt)])[0].logits, want)
        counters, n, row = stage.timings.spill, len(prompt), cfg.hidden_size * 4
        assert counters.forwards == 1
        # every layer reads its banked blocks back, the head its last row's; each block is written once
        head = cfg.blocks_entering(cfg.num_layers) * row
        assert counters.bytes_read == spill_read_bytes(cfg, 0, cfg.num_layers, n, 4) + head
        assert counters.bytes_written == spill_write_bytes(cfg, 0, cfg.num_layers, n, 4) == \
            n * cfg.blocks_entering(cfg.num_layers) * row
        assert os.listdir(tmp_path / "spill") == []  # the file went with its forward
        assert stage.stats().spill_bytes_written == counters.bytes_written
        for step in range(3):  # the sessions' caches are the ones the held forward left
            nxt = torch.tensor([int(want[-1].argmax()) if step == 0 else 7 + step])
            want = held.forward([SeqInput("h", n + step, ids=nxt)])[0].logits
            assert torch.equal(stage.forward([SeqInput("s", n + step, ids=nxt)])[0].logits, want)
        assert stage.timings.spill.forwards == 1  # decode steps hold their rows
    finally:
        stage.close()
        held.close()


def test_a_spilled_prompt_reads_each_expert_once_with_the_cache_lent(tiny_dir: Path, tmp_path: Path) -> None:
    """The streamed stage as planned: one forward, each touched expert read once; its logits are the held stage's up
    to rounding (an expert's terms add as its read lands: the order differs run to run by ~1e-6)."""
    cfg, prompt = load_config(tiny_dir), _prompt(tiny_dir)
    held = LocalPipeline.load(tiny_dir, 1, device="cpu")
    stage = _spilling_stage(tiny_dir, tmp_path / "spill", 4)
    try:
        want = held.forward([SeqInput("h", 0, ids=prompt)])[0].logits
        got = stage.forward([SeqInput("s", 0, ids=prompt)])[0].logits
        assert ((got - want).norm() / want.norm()) < 1e-5 and got.argmax() == want.argmax()
        experts = stage.experts.snapshot_stats()  # type: ignore[attr-defined]
        assert stage.timings.spill.forwards == 1 and stage.experts.slots.lent  # type: ignore[attr-defined]
        every = len(cfg.moe_layers) * cfg.num_experts  # 1,323 tokens touch every expert of every layer: once each
        assert experts.lookups == every and experts.bytes_read <= every * expert_slot_bytes(cfg)
    finally:
        stage.close()
        held.close()


def test_a_prompt_within_the_lent_forward_does_not_spill(tiny_dir: Path, tmp_path: Path) -> None:
    stage = _spilling_stage(tiny_dir, tmp_path / "spill", 4)
    try:
        stage.forward([SeqInput("s", 0, ids=torch.arange(PROMPT_FORWARD) % 100)])
        assert stage.timings.spill.forwards == 0
    finally:
        stage.close()


def test_a_disk_without_room_refuses_the_forward_before_any_session_changes(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stage = _spilling_stage(tiny_dir, tmp_path / "spill", 4)
    try:
        stage.forward([SeqInput("s", 0, ids=torch.arange(5))])
        monkeypatch.setattr(spill_mod.shutil, "disk_usage", lambda _path: Usage(1 << 40, 1 << 40, 10 << 20))
        with pytest.raises(DeltafinError, match=r"GB of its rows' states on the disk.*--spill-dir.*--no-spill"):
            stage.forward([SeqInput("s", 5, ids=torch.arange(SPILLED - 5) % 100)])
        assert stage.sessions["s"].length == 5  # as it was: the next token goes on from there
        assert stage.timings.spill.forwards == 0 and not stage.experts.slots.lent  # type: ignore[attr-defined]
    finally:
        stage.close()
