"""`deltafin bench --disk`'s refusal of too little data to measure; `bench --kernel`'s spine matmul (bf16, int8,
q4 at decode and prefill): its byte counts, speeds and products checked against float64."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltafin.cli import bench_kernels
from deltafin.cli.bench_kernels import bench_disk, bench_spine
from deltafin.cli.commands import main
from deltafin.errors import DeltafinError
from deltafin.kernels.cpu import ISA


def test_bench_disk_needs_a_gigabyte_of_large_files(tmp_path: Path) -> None:
    (tmp_path / "small.bin").write_bytes(b"\0" * (1 << 20))
    with pytest.raises(DeltafinError, match="need at least 1 GB of files"):
        bench_disk(tmp_path, read_size=4096)


SMALL_SPINE = {"odd": (333, 640), "wide": (520, 2048)}  # rows off the 8-row decode block; 10 and 32 groups a row


def _check_spine(spine: dict, shapes: dict[str, tuple[int, int]], prefill: int, rotation: int) -> None:
    """The spine benchmark's JSON: structure, byte counts from the shapes, GB/s = bytes / time, every format's
    product equal to float64 of its own weights, and each format's error against bf16 as its step size predicts."""
    assert spine["tokens"] == {"decode": 1, "prefill": prefill} and spine["device"] == "cpu"
    assert [(m["matrix"], m["rows"], m["cols"]) for m in spine["matrices"]] == [(n, *rc) for n, rc in shapes.items()]
    for m in spine["matrices"]:
        rows, cols, formats = m["rows"], m["cols"], m["formats"]
        assert set(formats) == {"bf16", "int8", "q4"}
        # bf16: 2 bytes a value; int8: 1 byte a value and an fp16 scale a row; q4: half a byte a value and an
        # fp16 scale and bias per 64 values
        want_bytes = {"bf16": 2 * rows * cols, "int8": rows * cols + 2 * rows,
                      "q4": rows * cols // 2 + 4 * rows * cols // 64}
        for fmt, r in formats.items():
            assert r["weight_bytes"] == want_bytes[fmt]
            assert r["copies"] == min(64, max(1, -(-rotation // want_bytes[fmt])))
            for phase in ("decode", "prefill"):
                ms, gbps = r[f"{phase}_ms"], r[f"{phase}_weight_GBps"]
                assert ms > 0 and gbps == pytest.approx(r["weight_bytes"] / (ms * 1e-3) / 1e9, rel=0.01, abs=2e-3)
            # fp32 activations: the kernels (decode) and the BLAS path (prefill) agree with float64 of the
            # format's own weights to fp32 summation error (sums of 2048 products: ~3e-6)
            assert r["rel_err"] < 1e-5, (m["matrix"], fmt, r["rel_err"])
        # Gaussian rows: int8's step is absmax/127 (~3.3 sigma / 127), q4's a 64-group's range / 15 (~4.6 sigma / 15);
        # rounding to it costs step / sqrt(12) of sigma: ~0.0075 and ~0.09
        assert formats["bf16"]["err_vs_bf16"] == 0.0
        assert 0.003 < formats["int8"]["err_vs_bf16"] < 0.02
        assert 0.05 < formats["q4"]["err_vs_bf16"] < 0.15
        speedup = formats["int8"]["decode_ms"] / formats["q4"]["decode_ms"]
        assert m["q4_speedup_over_int8_decode"] == pytest.approx(speedup, rel=1e-3)


def test_bench_spine_times_each_format_and_checks_its_product() -> None:
    rotation = 3 * 10**6  # several copies of the small formats, one of bf16 "wide" (2.1 MB)
    spine = bench_spine("cpu", repeats=2, shapes=SMALL_SPINE, prefill_tokens=37, rotation_bytes=rotation)
    _check_spine(spine, SMALL_SPINE, 37, rotation)
    assert spine["path"] in ISA.values()  # the C kernels ran (not the torch reference)


def test_bench_kernel_prints_the_expert_and_the_spine(monkeypatch, capsys) -> None:
    """`deltafin bench --kernel`: the MXFP4 expert's fields as before, and the spine's (at small shapes here: K3's
    take a minute on two cores)."""
    monkeypatch.setattr(bench_kernels, "K3_SPINE", SMALL_SPINE)
    monkeypatch.setattr(bench_kernels, "ROTATION_BYTES", 0)
    assert main(["bench", "--kernel", "--device", "cpu", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "mxfp4" and out["tokens"] == 1 and out["expert_bytes"] == 3 * 3072 * 3584 * 17 // 32
    assert out["matrix_ms"] > 0 and out["expert_ms"] > 0 and out["experts_in_turn"] == 1  # no rotation asked
    _check_spine(out["spine"], SMALL_SPINE, 64, 0)
    probe = out["probe"]  # the compute probe at K3's width beside the benchmark's expert (its spine shapes differ)
    assert probe["matrix"] == [12288, 7168] and probe["expert_vs_kernel"] > 0
    assert set(probe["spine_one_GFLOPs"]) == {"bf16", "int8", "q4"} and "spine_one_vs_kernel" not in probe


def test_the_probe_is_set_beside_the_benchmarks_figures_for_the_same_matrix(monkeypatch) -> None:
    """`probe_against_kernels`' ratios: the probe's one-token GFLOP/s over the benchmark's decode of the same matrix,
    and the benchmark's expert time over the probe's (a known reading here, so the arithmetic is checked)."""
    from deltafin.plan.cluster.compute import ComputeSpeed

    rows, cols = 12288, 7168
    flop = 2 * rows * cols
    speed = ComputeSpeed(4e-3, 1e-4, {"bf16": flop / 5e-3, "int8": flop / 2.5e-3, "q4": flop / 2e-3},
                         {"bf16": 1e11, "int8": 1e11, "q4": 1e11}, spread=0.05)
    monkeypatch.setattr(bench_kernels, "measure_compute", lambda cfg, dev, dt: speed)
    spine = {"matrices": [{"rows": rows, "cols": cols, "formats": {"bf16": {"decode_ms": 4.0}, "int8": {
        "decode_ms": 2.5}, "q4": {"decode_ms": 2.5}}}]}
    out = bench_kernels.probe_against_kernels("cpu", "fp32", {"tokens": 1, "expert_ms": 5.0}, spine)
    assert out["spine_one_vs_kernel"] == {"bf16": 0.8, "int8": 1.0, "q4": 1.25}
    assert out["expert_vs_kernel"] == 1.25 and out["spread"] == 0.05 and out["expert_one_ms"] == 4.0
