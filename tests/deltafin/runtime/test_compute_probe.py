"""The compute probe: it times the stages' own kernels on the model's shapes, and its arithmetic turns those times
into the speeds the plan prices (kernels replaced by ones of known cost); a worker announces what it measured."""

from __future__ import annotations

import time

import pytest
import torch

from deltafin.checkpoint.config import load_config
from deltafin.kernels.quant import Int8Weight, MXFP4Weight, Q4Weight
from deltafin.plan.cluster.compute import ComputeSpeed
from deltafin.runtime import compute_probe
from deltafin.runtime.compute_probe import (
    CPU_BATCHED_OUT,
    PROMPT_ROWS,
    SPINE_ROWS,
    ComputeReadings,
    measure_compute,
    probe_matrix,
)
from deltafin.transport import worker_info


def test_the_probe_turns_known_kernel_times_into_speeds(small_dir, monkeypatch):
    cfg = load_config(small_dir)
    seen: list[tuple[int, ...]] = []

    def expert_ffn(c, e, z):  # 2 ms for one token, 0.5 ms a token batched
        assert c is cfg and isinstance(e.w1, MXFP4Weight) and e.w1.shape == (cfg.moe_intermediate_size,
                                                                                cfg.expert_dim)
        seen.append(tuple(z.shape))
        time.sleep(2e-3 if z.shape[0] == 1 else 0.5e-3 * z.shape[0])
        return z

    cost = {torch.Tensor: 1.0, Int8Weight: 2.0, Q4Weight: 4.0}  # relative seconds a FLOP
    rows, cols = probe_matrix(cfg).shape
    out = min(rows, CPU_BATCHED_OUT)

    def linear(x, w):
        assert w.shape == ((rows, cols) if x.shape[0] == 1 else (out, cols))
        time.sleep(next(v for k, v in cost.items() if isinstance(w, k)) * 2 * x.shape[0] * w.shape[0]
                   * cols / 1e12 + 1e-3)
        return x

    monkeypatch.setattr(compute_probe, "expert_ffn", expert_ffn)
    monkeypatch.setattr(compute_probe, "linear", linear)
    s = measure_compute(cfg, torch.device("cpu"), torch.float32)
    assert (1, cfg.expert_dim) in seen and (PROMPT_ROWS, cfg.expert_dim) in seen
    # sleeps overshoot a little, never undershoot: the measured times are at least the slept ones
    assert 2e-3 <= s.expert_one_s < 4e-3
    assert 0.5e-3 <= s.expert_token_s < 0.6e-3
    flop_many = 2 * SPINE_ROWS * out * cols
    for fmt, rel in (("bf16", 1.0), ("int8", 2.0), ("q4", 4.0)):
        want = flop_many / (rel * flop_many / 1e12 + 1e-3)
        assert want * 0.7 < s.spine_many[fmt] <= want * 1.01
        assert s.spine_one[fmt] < s.spine_many[fmt]  # one token: the 1 ms pass dominates


def test_the_real_kernels_are_faster_batched_and_the_description_travels(small_dir):
    cfg = load_config(small_dir)
    s = measure_compute(cfg, torch.device("cpu"), torch.float32)
    assert s.expert_token_s * PROMPT_ROWS > 0 and s.expert_one_s > 0
    assert all(s.spine_one[f] > 0 and s.spine_many[f] > 0 for f in ("bf16", "int8", "q4"))
    d = worker_info.WorkerDescription("w", "h:1", "cpu", 1, 1.0, "f", ((0, 2),), True, compute=s)
    back = worker_info.decode_info(worker_info.encode_info(d), "h:1")
    assert back.compute == s
    bare = worker_info.WorkerDescription("w", "h:1", "cpu", 1, 1.0, "f", ((0, 2),), True)
    assert worker_info.decode_info(worker_info.encode_info(bare), "h:1").compute is None


@pytest.mark.parametrize("rows", [1, SPINE_ROWS])
def test_the_probe_times_what_a_stage_runs(small_dir, rows):
    """Its spine rate is the rate of `linear` on a matrix of the model's width, as the stages call it."""
    from deltafin.kernels.linear import linear
    from deltafin.kernels.quant import quantize_int8_rows
    cfg = load_config(small_dir)
    s = measure_compute(cfg, torch.device("cpu"), torch.float32)
    out, cols = probe_matrix(cfg).shape
    w = quantize_int8_rows(torch.randn(out, cols).to(torch.bfloat16))
    x = torch.randn(rows, cols)
    best = min(_timed(lambda: linear(x, w)) for _ in range(5))
    rate = 2 * rows * out * cols / best
    measured = s.spine_one["int8"] if rows == 1 else s.spine_many["int8"]
    assert rate / 4 < measured < rate * 4  # the same kernel, timed twice on a shared CPU: within a factor of 4


def _timed(run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def test_a_format_that_cannot_hold_the_matrix_is_timed_as_its_fallback(tmp_path, monkeypatch):
    """A hidden size of no whole 64-value groups: q4 holds none of the matrix's rows, so a q4 spine holds it row-int8
    (formats/q4.py) and the probe times int8's kernel for it instead of failing (it once stopped the worker)."""
    from deltafin.mini.synth import synthesize

    cfg = load_config(synthesize("odd", tmp_path / "odd", show_progress=False))
    assert cfg.hidden_size % 64 != 0
    kinds = []
    real = compute_probe.linear
    monkeypatch.setattr(compute_probe, "linear", lambda x, w: kinds.append(type(w)) or real(x, w))
    s = measure_compute(cfg, torch.device("cpu"), torch.float32)
    assert set(s.spine_one) == {"bf16", "int8", "q4"} and all(v > 0 for v in s.spine_one.values())
    assert Q4Weight not in kinds and Int8Weight in kinds


def test_a_one_token_rate_is_bounded_by_the_memory_speed(small_dir, monkeypatch):
    """A reading faster than the device's memory can feed the weights (a matrix that sat in a cache) is cut to
    CEILING times it: here a memory of 0.1 GB/s, far below what any CPU reads, so every format is cut."""
    cfg = load_config(small_dir)
    monkeypatch.setattr(compute_probe, "_memory_bytes_per_s", lambda device: 1e8)
    s = measure_compute(cfg, torch.device("cpu"), torch.float32)
    ceiling = compute_probe.CEILING
    assert s.spine_one["bf16"] == pytest.approx(ceiling * 2 * 1e8 / 2)  # 2 FLOP a weight, 2 bytes a weight
    assert s.spine_one["int8"] == pytest.approx(ceiling * 2 * 1e8 / 1)
    assert s.spine_many["bf16"] > s.spine_one["bf16"]  # a batch is bound by FLOP, not cut


def _speed(t: float, rate: float, spread: float = 0.0) -> ComputeSpeed:
    return ComputeSpeed(t, t / 10, {"bf16": rate}, {"bf16": 10 * rate}, spread)


def test_readings_announce_their_median_and_how_far_they_disagree():
    """One reading taken in a busy moment (five times slower) moves neither the median nor the plan."""
    r = ComputeReadings([_speed(1e-3, 100e9, 0.02)])
    assert r.speed == _speed(1e-3, 100e9, 0.02)
    r.add(_speed(5e-3, 20e9, 0.02))
    r.add(_speed(1.1e-3, 95e9, 0.04))
    s = r.speed
    assert s.expert_one_s == 1.1e-3 and s.spine_one["bf16"] == 95e9 and s.spine_many["bf16"] == 950e9
    assert s.spread == pytest.approx((5e-3 - 1e-3) / 1.1e-3)  # they disagree: the plan is told how far
    for _ in range(10):
        r.add(_speed(1e-3, 100e9, 0.02))
    assert len(r.readings) == compute_probe.KEEP_READINGS and r.speed.spread == pytest.approx(0.02)


def test_a_stage_on_mlx_has_its_experts_timed_on_mlx(small_dir, monkeypatch):
    """Where the stage runs its routed experts on MLX (the Mac's path; MLX's CPU backend here), so does the probe:
    its expert times are MLX's `gather_qmm` calls, not torch's."""
    pytest.importorskip("mlx.core", reason="the test extra installs mlx[cpu]")
    from deltafin.kernels import linear as linear_mod

    cfg = load_config(small_dir)
    calls = []
    real = compute_probe.run_experts
    monkeypatch.setattr(compute_probe, "run_experts", lambda *a, **k: calls.append(a[2].shape[0]) or real(*a, **k))
    monkeypatch.setattr(compute_probe, "expert_ffn", lambda *a: pytest.fail("the torch expert path was timed"))
    linear_mod.select_kernels("mlx")
    try:
        s = measure_compute(cfg, torch.device("cpu"), torch.float32)
    finally:
        linear_mod.select_kernels("auto")
    assert {1, PROMPT_ROWS} <= set(calls) and s.expert_one_s > 0 and s.expert_token_s > 0


def test_a_reading_is_given_up_between_rounds_when_asked(small_dir):
    """An idle worker's reading stops after a round once a call comes in (`should_stop`), not after the whole probe."""
    from deltafin.kernels.timing import Stopped

    cfg = load_config(small_dir)
    asked = []
    with pytest.raises(Stopped):
        measure_compute(cfg, torch.device("cpu"), torch.float32, should_stop=lambda: asked.append(1) or True)
    assert len(asked) == 1  # the first round's end
