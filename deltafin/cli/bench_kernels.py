"""Kernel and disk micro-benchmarks that print JSON (`deltafin bench --kernel`, `deltafin bench --disk`): one
real-size K3 expert's MXFP4 dequant+matmul (or MLX's experts at K3's width), K3's big spine matrices in each
spine format (deltafin/formats: bf16 as stored, row-int8, q4) at decode and prefill through `linear` (whatever
fast path the device has), and random whole-block reads from a checkpoint's files, against the physical limit
(docs/PERF.md). The model benchmarks are bench.py's.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltafin.checkpoint.config import parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.devices import exact_fp32, resolve_device, resolve_dtype
from deltafin.errors import DeltafinError
from deltafin.formats import converted_spines, spine_format, spine_formats, stored_spine, weight_format
from deltafin.formats.mxfp4 import MXFP4
from deltafin.kernels.linear import Weight, expert_backend, fast_path, linear, mxfp4_linear
from deltafin.kernels.mlx_moe import MLXSlots, run_experts
from deltafin.kernels.quant import MXFP4Weight
from deltafin.kernels.timing import copies, in_turn, interleaved_seconds, weight_bytes
from deltafin.models.common import activation
from deltafin.models.moe import expert_ffn
from deltafin.models.weights import ExpertWeights
from deltafin.runtime.compute_probe import measure_compute, probe_matrix
from deltafin.weights.directio import ALIGN, align_down, align_up
from deltafin.weights.diskspeed import measure_reads
from deltafin.weights.reader import Extent, ReadPlan

K3_EXPERT = {"w1": (3072, 3584), "w2": (3584, 3072), "w3": (3072, 3584)}  # logical [rows, cols]
# Three of K3's big spine matrices, [rows, cols] (docs/K3_SPEC.md, "Tensors"): what a decode step mostly reads.
K3_SPINE = {
    "kda q/k/v/g_proj": (12288, 7168),  # hidden -> 96 heads x 128 (MLA's g_proj too)
    "attention o_proj": (7168, 12288),  # KDA's and MLA's output projection
    "shared experts gate/up_proj": (6144, 7168),
}
ROTATION_BYTES = 512 * 10**6  # a format's copies, taken in turn, exceed any last-level cache: weights come from memory
CHECK_ROWS = 64  # output columns checked against float64, per matrix and format
GB = 1e9


def _sustained_seconds(fn: Callable[[], object], device: torch.device, repeats: int, rounds: int = 5) -> float:
    """Seconds per call with calls issued back to back (kernels/timing.py): median over rounds."""
    return interleaved_seconds({"fn": fn}, device, repeats, rounds)["fn"]


# ---- disk ---------------------------------------------------------------------------------------------


def bench_disk(path: str | Path, read_size: int = 17_547_264, threads: int = 8, io: str = "direct",
               total_bytes: int = 4 * 10**9, seed: int = 0) -> dict[str, Any]:
    """Random whole-block reads of `read_size` bytes from the files under `path` (at least 1 GB of them)."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    files = [f for f in files if f.stat().st_size >= read_size + ALIGN]
    if not files or sum(f.stat().st_size for f in files) < 10**9:
        raise DeltafinError(f"{path}: need at least 1 GB of files of {read_size} bytes or more to measure the disk "
                            "(use a checkpoint directory, or a large file)")
    rng = random.Random(seed)
    count = max(8, total_bytes // read_size)
    plans, seen = [], set()
    while len(plans) < count and len(seen) < 10 * count:
        f = rng.choice(files)
        start = align_down(rng.randrange(0, f.stat().st_size - read_size))
        if (f, start) in seen:
            continue
        seen.add((f, start))
        span = align_up(read_size)
        plans.append(ReadPlan((Extent(f, start, start + span, 0, span),), ()))
    return {"bench": "disk", "path": str(path), **measure_reads(plans, io, threads)}


# ---- kernels ------------------------------------------------------------------------------------------


def bench_mxfp4(device: str = "auto", dtype: str = "fp32", tokens: int = 1, repeats: int = 20) -> dict[str, Any]:
    """Dequant+matmul of a real-size K3 expert (3 x 3584x3072 MXFP4, 17.5 MB) against `tokens` inputs, up to 32 of
    them taken in turn so that their bytes come from memory (with --kernels mlx: MLX's experts, one expert for
    `tokens` tokens and a decode layer's 16)."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    if expert_backend(dev.type) == "mlx":
        return bench_mlx_experts(tokens, repeats)
    if dt == torch.float32:
        exact_fp32()
    g = torch.Generator().manual_seed(0)
    packed = sum(r * c // 2 + r * c // 32 for r, c in K3_EXPERT.values())
    experts = [_random_expert(g, dev) for _ in range(max(1, min(32, math.ceil(ROTATION_BYTES / packed))))]
    x = torch.randn(tokens, 3584, generator=g).to(dev, dt)
    mxfp4_linear(x, experts[0].w1)  # builds and self-checks the fast path
    # experts taken in turn, as a decode step's come from memory, not from a cache that holds one (an H200's 50 MB)
    t_matrix = _sustained_seconds(in_turn(lambda w: mxfp4_linear(x, w), [e.w1 for e in experts]), dev, repeats)
    cfg = parse_config(preset_config("k3-slice", 2))
    t_expert = _sustained_seconds(in_turn(lambda e: expert_ffn(cfg, e, x), experts), dev, repeats)
    w1 = experts[0].w1
    fast = fast_path(dev.type)
    return {
        "bench": MXFP4.name, "device": str(dev), "dtype": dtype, "tokens": tokens,
        "path": getattr(fast, "isa", type(fast).__name__) if fast is not None else "torch reference",
        "threads": torch.get_num_threads(),
        "matrix_ms": round(t_matrix * 1e3, 3),
        "matrix_packed_GBps": round(w1.nbytes / t_matrix / GB, 2),
        "expert_ms": round(t_expert * 1e3, 3),
        "expert_packed_GBps": round(packed / t_expert / GB, 2),
        "expert_bytes": packed, "experts_in_turn": len(experts),
    }


def _random_expert(g: torch.Generator, dev: torch.device) -> ExpertWeights:
    """A K3-size expert of random codes, scales near 2**-8 (valid E8M0)."""
    mats = {name: MXFP4Weight(torch.randint(0, 256, (r, c // 2), dtype=torch.uint8, generator=g),
                              torch.randint(118, 122, (r, c // 32), dtype=torch.uint8, generator=g)).to(dev)
            for name, (r, c) in K3_EXPERT.items()}
    return ExpertWeights(mats["w1"], mats["w2"], mats["w3"])


def bench_mlx_experts(tokens: int = 1, repeats: int = 20) -> dict[str, Any]:
    """MLX's experts at K3's width (kernels/mlx_moe.py): one expert for `tokens` tokens, and one token through
    the 16 experts of a decode layer, in one evaluation each. Packed GB/s of expert bytes read."""
    import mlx.core as mx  # lazily: MLX exists on Apple silicon only (this runs with --kernels mlx)

    cfg = parse_config(preset_config("k3-slice", 2))
    k = cfg.experts_per_token
    slots = MLXSlots(cfg, k)
    rng = np.random.default_rng(0)
    for s in range(k):  # random codes, scales near 2**-8 (valid E8M0)
        for j, region in enumerate(slots.regions(s)):
            np.frombuffer(region, dtype=np.uint8)[:] = rng.integers(0, 256, len(region), dtype=np.uint8) \
                if j % 2 == 0 else rng.integers(118, 122, len(region), dtype=np.uint8)
    act, g = activation(cfg), torch.Generator().manual_seed(0)
    z = torch.randn(tokens, cfg.expert_dim, generator=g)
    one = lambda: run_experts(slots, act, z, torch.zeros(tokens, 1, dtype=torch.long), torch.ones(tokens, 1),
                              lambda e: e)
    z1 = z[:1]
    layer = lambda: run_experts(slots, act, z1, torch.arange(k).view(1, k), torch.full((1, k), 1 / k), lambda e: e)
    cpu = torch.device("cpu")
    t_expert, t_layer = _sustained_seconds(one, cpu, repeats), _sustained_seconds(layer, cpu, repeats)
    expert_bytes = cfg.bytes_per_expert
    slots.release_memory()
    return {"bench": MXFP4.name, "path": f"mlx {mx.__version__} ({mx.default_device()})", "tokens": tokens,
            "expert_ms": round(t_expert * 1e3, 3), "expert_packed_GBps": round(expert_bytes / t_expert / GB, 2),
            "layer_experts": k, "layer_ms": round(t_layer * 1e3, 3),
            "layer_packed_GBps": round(k * expert_bytes / t_layer / GB, 2), "expert_bytes": expert_bytes}


# ---- spine matmul -------------------------------------------------------------------------------------


def _spine_weight(dense: torch.Tensor, fmt: str) -> Weight:
    return spine_format(fmt).quantize(dense)


def _reference_rows(w: Weight, k: int) -> torch.Tensor:
    """The first k rows of W as the format defines them, float64 on the host (the kernels' reference): each of
    a quantized weight's arrays holds a row's values, scales or biases in its row."""
    if isinstance(w, torch.Tensor):
        return w[:k].cpu().double()
    fmt = weight_format(w)
    return fmt.dequantize(type(w)(*(a[:k].cpu() for a in fmt.arrays(w))), torch.float64)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-300))


def _bench_matrix(dense: torch.Tensor, dev: torch.device, inputs: dict[str, torch.Tensor], repeats: int,
                  rotation_bytes: int) -> dict[str, dict[str, Any]]:
    """Each format's ms and weight GB/s of y = x @ W.T for each input (copies of W taken in turn, so W comes from
    memory, not a cache), its worst relative error against float64 of its own weights, and against bf16's."""
    weights = {fmt.name: _spine_weight(dense, fmt.name).to(dev) for fmt in spine_formats()}
    results: dict[str, dict[str, Any]] = {}
    rings = {fmt: copies(w, rotation_bytes) for fmt, w in weights.items()}
    for fmt, ring in rings.items():
        results[fmt] = {"weight_bytes": weight_bytes(ring[0]), "copies": len(ring)}
    for phase, x in inputs.items():
        reps = repeats if phase == "decode" else max(1, repeats // 10)  # prefill is compute: fewer calls time it
        times = interleaved_seconds({fmt: in_turn(lambda w, x=x: linear(x, w), ring) for fmt, ring in rings.items()},
                                    dev, reps, rounds=5 if phase == "decode" else 3)
        for fmt, t in times.items():
            results[fmt][f"{phase}_ms"] = round(t * 1e3, 4)
            results[fmt][f"{phase}_weight_GBps"] = round(results[fmt]["weight_bytes"] / t / GB, 3)
    del rings
    for fmt, w in weights.items():
        want_rows, errors, vs_bf16 = _reference_rows(w, CHECK_ROWS), [], []
        for x in inputs.values():
            y = linear(x, w)[:, :CHECK_ROWS].cpu()
            errors.append(_rel(y, torch.nn.functional.linear(x.cpu().double(), want_rows)))
            vs_bf16.append(_rel(y, linear(x, weights[stored_spine()])[:, :CHECK_ROWS].cpu().double()))
        results[fmt]["rel_err"], results[fmt]["err_vs_bf16"] = max(errors), max(vs_bf16)
    return results


def bench_spine(device: str = "auto", dtype: str = "fp32", prefill_tokens: int | None = None, repeats: int = 20,
                shapes: dict[str, tuple[int, int]] | None = None,
                rotation_bytes: int | None = None) -> dict[str, Any]:
    """Each spine format of K3's big spine matrices (`shapes`, default K3_SPINE) at decode (1 token) and a
    prefill chunk (`prefill_tokens`, default 512 on an accelerator, 64 on the CPU) through `linear`, the formats
    timed in interleaved rounds: ms, weight GB/s (each format's copies taken in turn add up to `rotation_bytes`,
    default ROTATION_BYTES), `rel_err` (the product against float64 of the format's own weights: the kernel's
    error), `err_vs_bf16` (against the bf16 matrix's product: what the format costs), and the speed-up at decode of
    the converted format of the fewest bytes over the next (q4's over int8: int8 ms / q4 ms)."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    if dt == torch.float32:
        exact_fp32()
    chunk = prefill_tokens or (64 if dev.type == "cpu" else 512)
    g = torch.Generator().manual_seed(0)
    matrices = []
    for name, (rows, cols) in (shapes or K3_SPINE).items():
        dense = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
        inputs = {"decode": torch.randn(1, cols, generator=g).to(dev, dt),
                  "prefill": torch.randn(chunk, cols, generator=g).to(dev, dt)}
        formats = _bench_matrix(dense, dev, inputs, repeats, ROTATION_BYTES if rotation_bytes is None else
                                rotation_bytes)
        small, next_up = converted_spines()[:2]
        speedup = formats[next_up]["decode_ms"] / formats[small]["decode_ms"]
        matrices.append({"matrix": name, "rows": rows, "cols": cols, "formats": formats,
                         f"{small}_speedup_over_{next_up}_decode": round(speedup, 3)})
    fast = fast_path(dev.type)
    return {"device": str(dev), "dtype": dtype, "tokens": {"decode": 1, "prefill": chunk},
            "path": getattr(fast, "isa", type(fast).__name__) if fast is not None else "torch reference",
            "threads": torch.get_num_threads(), "matrices": matrices}


def probe_against_kernels(device: str, dtype: str, experts: dict[str, Any], spine: dict[str, Any]) -> dict[str, Any]:
    """What a worker's compute probe (runtime/compute_probe.py) measures on this device at K3's width, beside this
    benchmark's own figures for the same expert and the same spine matrix (`experts`: bench_mxfp4's result at one
    token, `spine`: bench_spine's): the plan prices with the probe, so the two should agree."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    cfg = parse_config(preset_config("k3-slice", 2))
    rows, cols = probe_matrix(cfg).shape
    speed = measure_compute(cfg, dev, dt)
    bench = next((m for m in spine["matrices"] if (m["rows"], m["cols"]) == (rows, cols)), None)
    out: dict[str, Any] = {
        "matrix": [rows, cols], "spread": round(speed.spread, 3), "expert_one_ms": round(speed.expert_one_s * 1e3, 3),
        "spine_one_GFLOPs": {f: round(v / GB, 2) for f, v in speed.spine_one.items()},
        "spine_many_GFLOPs": {f: round(v / GB, 2) for f, v in speed.spine_many.items()}}
    if experts.get("tokens") == 1 and "expert_ms" in experts:
        out["expert_vs_kernel"] = round(experts["expert_ms"] / (speed.expert_one_s * 1e3), 3)
    if bench is not None:  # the benchmark's decode of the same matrix, as GFLOP/s: probe / benchmark
        out["spine_one_vs_kernel"] = {
            f: round(speed.spine_one[f] / (2 * rows * cols / (r["decode_ms"] / 1e3)), 3)
            for f, r in bench["formats"].items() if f in speed.spine_one}
    return out
