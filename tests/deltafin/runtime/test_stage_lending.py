"""A prompt's forward borrows the expert cache (plan/memory/sizing.py `_lend_cache`, runtime/stage.py `_expert_room`): a
forward longer than the plan's `forward_tokens` runs with the cache's slots given back to the system, computing what
a stage with every expert resident computes, and the next short forward (decode) takes the cache back."""

from __future__ import annotations

import dataclasses
import mmap
import sys
from pathlib import Path

import pytest
import torch

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import open_checkpoint
from deltafin.plan.memory.forward_workspace import workspace_bytes
from deltafin.plan.memory.layer_table import layer_table
from deltafin.plan.memory.sizing import Placement, SizingInput, lent, size_stage
from deltafin.plan.memory.stage_parts import expert_slot_bytes
from deltafin.plan.memory.stage_plan import Budget
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage import Stage
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import StageOptions
from deltafin.weights.reader import layer_spans

CPU = torch.device("cpu")
PROMPT = torch.tensor([5, 100, 300, 7, 9, 700, 12, 44, 3, 1000, 2, 17, 8, 64, 250, 31])  # 16 tokens
FORWARD, LONGEST, CACHE_EXPERTS = 4, 32, 12


def _lending_stage(model: Path, place: Placement | None = None) -> Stage:
    """A stage planned as `choose` plans a lending one: forwards of FORWARD tokens beside a cache of
    CACHE_EXPERTS slots, prompts of up to LONGEST with the cache lent, and a budget that holds both."""
    cfg = load_config(model)
    ckpt = open_checkpoint(model, cfg)
    options = StageOptions(sizing=SizingInput(spine="bf16", read_threads=2))
    inputs = options.sizing_for(ckpt.config, layer_spans(ckpt))
    cache, place = CACHE_EXPERTS * expert_slot_bytes(cfg), place or Placement("cpu")
    plan = size_stage(cfg, 0, cfg.num_layers, place, "bf16", cache, cfg.num_layers,
                      dataclasses.replace(inputs, prefill_chunk=FORWARD, prompt_tokens=LONGEST))
    borrowed = lent(cfg, plan, place, inputs, LONGEST)
    assert plan.prompt_tokens == LONGEST and borrowed.expert_cache == 0 < plan.expert_cache
    budget = max(plan.total, borrowed.total)
    assert Budget(budget).fits(plan) and Budget(budget).fits(borrowed)
    return Stage(ckpt, 0, cfg.num_layers, device=CPU, options=options.replace(memory_bytes=budget), plan=plan)


def _cache_page(stage: Stage) -> memoryview:
    """The first page of the last cache slot's memory (past the working slots)."""
    pool = stage.experts.slots.pool  # type: ignore[attr-defined]
    last = stage.experts.slots.working + stage.experts.slots.cache_slots - 1  # type: ignore[attr-defined]
    return pool.view[last * pool.size:last * pool.size + mmap.PAGESIZE]


def test_a_long_prompt_borrows_the_cache_and_decode_takes_it_back(tiny_dir: Path) -> None:
    resident = LocalPipeline.load(tiny_dir, 1, device="cpu")
    stage = _lending_stage(tiny_dir)
    store = stage.experts
    try:
        assert stage.max_forward_tokens == LONGEST  # what the coordinator cuts prompts to
        # a short forward fills the cache as usual
        short = stage.forward([SeqInput("warm", 0, ids=PROMPT[:FORWARD])])[0].logits
        assert torch.equal(short, resident.forward([SeqInput("rw", 0, ids=PROMPT[:FORWARD])])[0].logits)
        assert store.cache.entries and not store.slots.lent
        _cache_page(stage)[:] = b"\x5a" * mmap.PAGESIZE  # a mark in the cache's own memory

        want = resident.forward([SeqInput("r", 0, ids=PROMPT)], all_logits=True)[0].logits
        got = stage.forward([SeqInput("s", 0, ids=PROMPT)], all_logits=True)[0].logits
        assert torch.equal(got, want)  # one forward of 16 > FORWARD tokens: what every expert resident gives
        assert store.slots.lent and store.cache.budget == 0 and not store.cache.entries
        # what the forward's workspace leaves of the cache and the plan's workspace stays, to read ahead
        room = stage.plan.expert_cache + stage.plan.workspace - workspace_bytes(
            stage.cfg, layer_table(stage.cfg, Placement("cpu")), 0, stage.cfg.num_layers, len(PROMPT),
            stage.plan.context, True)
        kept = max(0, min(CACHE_EXPERTS - 1, room // expert_slot_bytes(stage.cfg)))
        assert store.slots.pool.count == store.slots.working + kept == store.slots.working + store.slots.kept
        if sys.platform.startswith("linux"):  # MADV_DONTNEED: the cache's pages went back (zero when touched)
            assert bytes(_cache_page(stage)) == bytes(mmap.PAGESIZE)

        for n in range(3):  # decode: the cache comes back, empty, and fills again
            nxt = torch.tensor([int(want[-1].argmax()) if n == 0 else 11 + n])
            a = stage.forward([SeqInput("s", len(PROMPT) + n, ids=nxt)])[0].logits
            b = resident.forward([SeqInput("r", len(PROMPT) + n, ids=nxt)])[0].logits
            assert torch.equal(a, b)
            assert not store.slots.lent and store.cache.budget == CACHE_EXPERTS * store.slot_bytes
        assert store.slots.pool.count == store.slots.working + CACHE_EXPERTS and store.cache.entries
    finally:
        stage.close()
        resident.close()


def test_a_prompt_longer_than_the_lent_forward_is_refused(tiny_dir: Path) -> None:
    from deltafin.errors import InvalidInput

    stage = _lending_stage(tiny_dir)
    try:
        ids = torch.arange(LONGEST + 1) % 50
        with pytest.raises(InvalidInput, match=f"sized for at most {LONGEST} per forward"):
            stage.forward([SeqInput("s", 0, ids=ids)])
        assert not stage.experts.slots.lent  # refused before anything was lent
    finally:
        stage.close()


def test_mlx_slots_are_lent_and_taken_back(tiny_dir: Path) -> None:
    """The Mac's path (MLX's CPU backend here): the MLX slot arrays are made again with the working slots only for
    the prompt, and with the cache's again for decode; the logits are the torch reference's (MLX's kernels round
    otherwise: within 5e-5, as tests/deltafin/kernels/test_mlx_moe.py holds them)."""
    pytest.importorskip("mlx.core", reason="the test extra installs mlx[cpu]")
    from deltafin.kernels import linear as linear_mod

    linear_mod.select_kernels("mlx")
    try:
        resident = LocalPipeline.load(tiny_dir, 1, device="cpu")
        stage = _lending_stage(tiny_dir, Placement("cpu", experts="mlx"))
    finally:
        linear_mod.select_kernels("auto")
    store = stage.experts
    try:
        assert stage.expert_backend == "mlx"
        full = store.pool.nbytes
        want = resident.forward([SeqInput("r", 0, ids=PROMPT)], all_logits=True)[0].logits
        got = stage.forward([SeqInput("s", 0, ids=PROMPT)], all_logits=True)[0].logits
        assert ((got - want).norm(dim=1) / want.norm(dim=1)).max() < 5e-5
        kept = store.slots.kept
        assert store.slots.lent and store.pool.slots.count == store.slots.working + kept < full // store.pool.size
        assert store.pool.nbytes == full * (store.slots.working + kept) // (store.slots.working + CACHE_EXPERTS)
        nxt = torch.tensor([int(want[-1].argmax())])
        a = stage.forward([SeqInput("s", len(PROMPT), ids=nxt)])[0].logits
        b = resident.forward([SeqInput("r", len(PROMPT), ids=nxt)])[0].logits
        assert ((a - b).norm() / b.norm()) < 5e-5
        assert not store.slots.lent and store.pool.nbytes == full and store.cache.entries
    finally:
        stage.close()
        resident.close()


def test_a_provider_that_lends_nothing_is_left_alone(tiny_dir: Path) -> None:
    """A provider put in the store's place (bench's replay reads a layer's experts when it asks) has no cache to
    lend: a long forward and a decode step run through it as they are."""
    resident = LocalPipeline.load(tiny_dir, 1, device="cpu")
    stage = _lending_stage(tiny_dir)
    store = stage.experts

    class Plain:  # the store's experts, and nothing else
        experts = staticmethod(store.experts)

    stage.experts = Plain()  # type: ignore[assignment]
    try:
        got = stage.forward([SeqInput("s", 0, ids=PROMPT)], all_logits=True)[0].logits
        assert torch.equal(got, resident.forward([SeqInput("r", 0, ids=PROMPT)], all_logits=True)[0].logits)
        stage.forward([SeqInput("s", len(PROMPT), ids=torch.tensor([3]))])
        assert not store.slots.lent
    finally:
        stage.experts = store
        stage.close()
        resident.close()
