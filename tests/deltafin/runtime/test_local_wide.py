"""The lossy wire (--wire bf16) in one process: what would cross the links is rounded to bfloat16 as the workers
send it (a stage's output states; the rows a stage sends other holders and the sums they answer), its own share
and the last stage's logits not; the result stays near the exact wire's and its greedy tokens."""

from __future__ import annotations

import torch

from deltafin.runtime.local_wide import LocalWide
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.wide import ExpertCall

IDS = torch.tensor([5, 100, 300, 7, 9, 700, 12, 44, 3, 1000, 2, 17])


def test_the_lossy_wire_rounds_what_crosses_and_stays_near_the_exact_one(small_dir):
    exact, lossy = LocalWide(small_dir, 2), LocalWide(small_dir, 2, wire="bf16")
    try:
        first = lossy.pipeline.stages[0]
        out = first.forward([SeqInput("a", 0, ids=IDS)])[0]
        assert out.state.P.dtype == out.state.B.dtype == torch.bfloat16  # half the hop's bytes
        seen: list[ExpertCall] = []
        holder = lossy.assigned["w1"].holder
        run = holder.run
        holder.run = lambda call: seen.append(call) or run(call)  # type: ignore[method-assign]
        got = lossy.pipeline.forward([SeqInput("b", 0, ids=IDS)], all_logits=True)[0].logits
        want = exact.pipeline.forward([SeqInput("b", 0, ids=IDS)], all_logits=True)[0].logits
        assert seen and all(c.bf16 and c.z.dtype == torch.bfloat16 for c in seen if c.z.shape[0])
        assert got.dtype == torch.float32 and not torch.equal(got, want)
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) < 0.05 * scale  # bf16's 8 bits of mantissa, through the layers
        assert int(got[-1].argmax()) == int(want[-1].argmax())
    finally:
        exact.close()
        lossy.close()


def test_a_wide_stage_counts_as_its_compute_only_its_own_waits(small_dir):
    """A holder's store also waits for the experts of the calls it serves (other stages' layers, on its serving
    thread): those waits are not its stage's, whose compute is its forwards' time less its own waits."""
    wide = LocalWide(small_dir, 2, cache_bytes=0)
    try:
        wide.pipeline.forward([SeqInput("a", 0, ids=IDS)])
        others = 0.0
        for key, (a, b) in zip(wide.keys, wide.ranges, strict=True):
            stage = wide.assigned[key].stage
            stats = stage.stats()
            store = stage.experts.snapshot_stats() if hasattr(stage.experts, "snapshot_stats") else None
            assert store is not None and store.io_wait_s > 0  # it read experts (no cache)
            own = store.over(range(a, b)).io_wait_s
            others += store.io_wait_s - own
            # the counters are rounded to 0.1 ms each
            assert stats.compute_s is not None
            assert abs(stats.compute_s - (stats.seconds - own - stats.spine_wait_s)) < 2e-4
            assert 0 <= stats.compute_s <= stats.seconds
        assert others > 0  # the holders waited for calls they served, and that was left out
    finally:
        wide.close()


def _wide_is_one_process_in(model, mode: str, wide: LocalWide, check=None) -> None:
    """`wide` gives what one process gives in `mode`, to the wide path's rounding, and not what exact gives (`check`
    first, on the wide cluster: what else it must have done)."""
    from deltafin.runtime.pipeline import LocalPipeline
    from deltafin.runtime.stage_options import StageOptions
    from tests.support.wide import wide_close

    one = LocalPipeline.load(model, 1, device="cpu", options=StageOptions(expert_mode=mode))
    exact = LocalPipeline.load(model, 1, device="cpu")
    try:
        if check is not None:
            check(wide)
        got = wide.pipeline.forward([SeqInput("m", 0, ids=IDS)], all_logits=True)[0].logits
        want = one.forward([SeqInput("m", 0, ids=IDS)], all_logits=True)[0].logits
        other = exact.forward([SeqInput("m", 0, ids=IDS)], all_logits=True)[0].logits
        assert wide_close(got, want)
        assert float((want - other).abs().max()) > 100 * float((got - want).abs().max())
    finally:
        wide.close()
        one.close()
        exact.close()


def test_wide_holders_compute_the_pairs_an_expert_mode_chose(small_dir):
    """In top-p, two wide stages (each holding half of every layer's experts) give what one process gives in the
    same mode, to the wide path's rounding, and not what exact gives: the owner routes, every holder computes the
    pairs it chose (the weight-0 pads add exact zeros wherever they run)."""
    _wide_is_one_process_in(small_dir, "top-p:0.5", LocalWide(small_dir, 2, expert_mode="top-p:0.5"))


def test_wide_holders_read_the_copy_of_their_share(small_dir, tmp_path, monkeypatch):
    """In q3, each of two wide stages and an expert-only holder converts the copy of its share of every layer (a
    third of each), and together they give what one process gives in q3 (its resident experts rounded in memory: the
    same rounding), to the wide path's rounding; not what exact gives."""
    from deltafin.formats import low_bit_format
    from deltafin.weights import expert_copy
    from deltafin.weights.expert_copy import ExpertCopy

    monkeypatch.setattr(expert_copy, "default_root", lambda model_dir, fmt: tmp_path / fmt)

    def converted_once(wide: LocalWide) -> None:  # every expert converted once, by the worker whose share it is
        copy = ExpertCopy.open(tmp_path / "q3", wide.cfg, low_bit_format("q3"))
        for layer in wide.cfg.moe_layers:
            assert copy.written(layer) == [range(wide.cfg.num_experts)]
            assert [len(wide.expert_ranges.share(i, layer)) for i in range(3)] != [0, 0, wide.cfg.num_experts]

    _wide_is_one_process_in(small_dir, "q3", LocalWide(small_dir, 2, holders=1, expert_mode="q3"), converted_once)
