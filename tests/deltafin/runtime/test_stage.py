"""Stage contract: inputs, sessions (ids, release, eviction with a clear error, sync), memory checks,
and a failed forward leaves every session as it was."""

from __future__ import annotations

import pytest
import torch

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import open_checkpoint
from deltafin.devices import resolve_device
from deltafin.errors import DeltafinError, InvalidInput, OutOfMemory, SessionNotFound, SessionOutOfSync
from deltafin.models.attn_res import ResidualState
from deltafin.plan.memory.sizing import SizingInput
from deltafin.plan.memory.stage_parts import sequence_bytes
from deltafin.runtime.stage import Stage
from deltafin.runtime.stage_build import plan_stage
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import StageOptions
from deltafin.weights.reader import layer_spans

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ckpt(tiny_dir):
    return open_checkpoint(tiny_dir, load_config(tiny_dir))


def test_memory_check_fails_clearly(ckpt):
    with pytest.raises(OutOfMemory, match=r"layers 0-5 cannot fit on cpu: .* at least [0-9.]+ GB .*budget is 0.00 GB"):
        Stage(ckpt, 0, 6, device=CPU, options=StageOptions(memory_bytes=100_000))
    fits = Stage(ckpt, 0, 6, device=CPU, options=StageOptions(memory_bytes=3 * 10**9))
    assert fits.plan.experts_resident and not fits.plan.streamed_layers


def test_input_validation(ckpt):
    first, middle = Stage(ckpt, 0, 3, device=CPU), Stage(ckpt, 3, 6, device=CPU)
    d = ckpt.config.hidden_size
    bad = [
        (first, SeqInput("a", 0, ids=torch.tensor([[1, 2]])), "1-D integer tensor"),
        (first, SeqInput("a", 0, ids=torch.tensor([1.0])), "1-D integer tensor"),
        (first, SeqInput("a", 0, ids=torch.tensor([5, 2000])), "token ids must be in [0, 1024)"),
        (first, SeqInput("a", -1, ids=torch.tensor([5])), "negative cache_len"),
        (middle, SeqInput("a", 0, ids=torch.tensor([5])), "takes a residual state"),
        (middle, SeqInput("a", 0, state=ResidualState(torch.zeros(2, d), torch.zeros(2, 1, d))), "B [T, 2, 64]"),
        (middle, SeqInput("a", 0, state=ResidualState(torch.full((1, d), float("nan")), torch.zeros(1, 2, d))),
         "NaN or Inf"),
    ]
    for stage, item, message in bad:
        with pytest.raises(InvalidInput) as e:
            stage.forward([item])
        assert message in str(e.value)
    with pytest.raises(InvalidInput, match="distinct session ids"):
        first.forward([SeqInput("a", 0, ids=torch.tensor([1])), SeqInput("a", 0, ids=torch.tensor([2]))])
    assert not first.sessions and not middle.sessions  # nothing was created by rejected calls


def test_sessions_sync_release_and_unknown(ckpt):
    stage = Stage(ckpt, 0, 6, device=CPU)
    stage.forward([SeqInput("s", 0, ids=torch.tensor([1, 2, 3]))])
    assert stage.sessions["s"].length == 3
    with pytest.raises(SessionOutOfSync, match="holds 3 tokens but the call says 2"):
        stage.forward([SeqInput("s", 2, ids=torch.tensor([4]))])
    stage.forward([SeqInput("s", 3, ids=torch.tensor([4]))])
    assert stage.release("s") and not stage.release("s")
    with pytest.raises(SessionNotFound, match="start it again with cache_len 0"):
        stage.forward([SeqInput("s", 4, ids=torch.tensor([5]))])


def _with_sessions(ckpt, session_bytes: int, context: int | None = None) -> Stage:
    """A stage of every layer whose plan (within 4 GB: everything else resident) gives the sessions `session_bytes`,
    as a coordinator's plan may."""
    options = StageOptions(memory_bytes=4 * 10**9).replace(context=context)
    plan = plan_stage(ckpt.config, 0, 6, CPU, options, layer_spans(ckpt), known={"session_bytes": session_bytes})
    return Stage(ckpt, 0, 6, device=CPU, options=options, plan=plan)


def test_eviction_names_the_evicted_session(ckpt):
    cfg = ckpt.config
    one = sequence_bytes(cfg, len(cfg.kda_layers), len(cfg.mla_layers), 2, 4)
    stage = _with_sessions(ckpt, int(2.5 * one))
    for sid in ("a", "b", "c"):
        stage.forward([SeqInput(sid, 0, ids=torch.tensor([1, 2]))])
    assert list(stage.sessions) == ["b", "c"]  # "a" was least recently used
    with pytest.raises(SessionNotFound, match="'a' is not on this stage .*evicted to make room"):
        stage.forward([SeqInput("a", 2, ids=torch.tensor([3]))])
    with pytest.raises(OutOfMemory, match="cannot hold this request"):
        stage.forward([SeqInput(s, 0, ids=torch.tensor([1])) for s in ("x", "y", "z")])


def test_sessions_resumed_from_a_kept_prompt_fit_the_budget_planned_for_them(ckpt):
    """The fuzz report's neighbours' streams that died on the session budget: a budget of N sequences at the
    context held N sessions started fresh but not N resumed from a kept prompt, because a resume was charged the
    prompt's kept logits (which stay with the prefix) on top of its caches."""
    cfg = ckpt.config
    context, n = 64, 3
    one = sequence_bytes(cfg, len(cfg.kda_layers), len(cfg.mla_layers), context, 4)
    stage = _with_sessions(ckpt, n * one, context)
    prompt = torch.arange(1, 61)
    stage.forward([SeqInput("first", 0, ids=prompt, save_at=((60, "p"),))])
    assert stage.prefixes.get("p", torch.float32).logits is not None  # the last stage kept the prompt's logits
    assert stage.release("first")
    resumed = [SeqInput(f"r{i}", 60, ids=torch.tensor([i + 1]), resume_from="p") for i in range(n)]
    out = stage.forward(resumed)
    fresh = Stage(ckpt, 0, 6, device=CPU)
    want = fresh.forward([SeqInput("f", 0, ids=torch.cat([prompt, torch.tensor([1])]))])[0].logits
    assert len(stage.sessions) == n and stage.sessions.nbytes <= n * one
    torch.testing.assert_close(out[0].logits, want, rtol=1e-4, atol=1e-5)  # fp32, two chunkings of one sum


def test_failed_forward_restores_sessions(ckpt):
    stage = Stage(ckpt, 0, 6, device=CPU)
    ids = torch.tensor([7, 8, 9, 10])
    stage.forward([SeqInput("s", 0, ids=ids[:2])])
    inner = stage.experts.experts
    calls = {"n": 0}

    def failing(layer, wanted):
        calls["n"] += 1
        if calls["n"] == 3:  # fail in the middle of the stack, after earlier layers updated their caches
            raise OSError("disk went away")
        return inner(layer, wanted)

    stage.experts.experts = failing  # type: ignore[method-assign]
    with pytest.raises(OSError):
        stage.forward([SeqInput("s", 2, ids=ids[2:3])])
    stage.experts.experts = inner  # type: ignore[method-assign]
    assert stage.sessions["s"].length == 2
    after = stage.forward([SeqInput("s", 2, ids=ids[2:3])])[0].logits
    fresh = Stage(ckpt, 0, 6, device=CPU)
    fresh.forward([SeqInput("t", 0, ids=ids[:2])])
    assert torch.equal(after, fresh.forward([SeqInput("t", 2, ids=ids[2:3])])[0].logits)


def test_device_errors_are_clear():
    if not torch.cuda.is_available():
        with pytest.raises(DeltafinError, match="CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(DeltafinError, match="unknown device"):
        resolve_device("tpu")
    assert resolve_device("cpu") == CPU


def test_debug_log_says_the_plan_and_each_forwards_reads_and_waits(ckpt, caplog):
    """-v on a generation: the plan's speed decisions once, then a line a forward whose expert counts and bytes
    are the store's own counters for that forward (a streamed cache of 1 MB on `tiny`: reads happen)."""
    import logging
    import re

    caplog.set_level(logging.DEBUG, logger="deltafin.runtime.stage")
    stage = Stage(ckpt, 0, 6, device=CPU, options=StageOptions(prefetch=False,
                                                               sizing=SizingInput(expert_cache_bytes=10**6)))
    try:
        (plan,) = [r.getMessage() for r in caplog.records if "plan:" in r.getMessage()]
        assert f"forwards of up to {stage.plan.forward_tokens} tokens" in plan and "expert cache 0.00 GB" in plan
        before = stage.experts.snapshot_stats()
        lookups, misses, read = before.lookups, before.misses, before.bytes_read
        caplog.clear()
        stage.forward([SeqInput("a", 0, ids=torch.arange(5))])
        after = stage.experts.snapshot_stats()
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("layers 0-5")]
        m = re.search(r"1 sequences, 5 tokens in [\d.]+s \(experts: (\d+) looked up: \d+ cached, 0 prefetched, "
                      r"(\d+) demand reads; ([\d.]+) MB read", line)
        assert m, line
        assert int(m.group(1)) == after.lookups - lookups > 0 and int(m.group(2)) == after.misses - misses > 0
        assert float(m.group(3)) == pytest.approx((after.bytes_read - read) / 1e6, abs=0.05)
    finally:
        stage.close()
