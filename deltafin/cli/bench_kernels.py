"""Kernel and disk micro-benchmarks that print JSON (`deltafin bench --kernel`, `deltafin bench --disk`): one
real-size K3 expert's MXFP4 dequant+matmul (or MLX's experts at K3's width), and random whole-block reads from
a checkpoint's files, against the physical limit (PERF.md). The model benchmarks are bench.py's.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltafin.checkpoint.config import parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.devices import exact_fp32, resolve_device, resolve_dtype, synchronize
from deltafin.errors import DeltafinError
from deltafin.kernels.linear import expert_backend, fast_path, mxfp4_linear
from deltafin.kernels.mlx_moe import MLXSlots, run_experts
from deltafin.kernels.quant import MXFP4Weight
from deltafin.models.common import activation
from deltafin.models.moe import expert_ffn
from deltafin.models.weights import ExpertWeights
from deltafin.weights.directio import ALIGN, align_down, align_up
from deltafin.weights.diskspeed import measure_reads
from deltafin.weights.reader import Extent, ReadPlan

K3_EXPERT = {"w1": (3072, 3584), "w2": (3584, 3072), "w3": (3072, 3584)}  # logical [rows, cols]
GB = 1e9


def _sustained_seconds(fn: Callable[[], object], device: torch.device, repeats: int, rounds: int = 5) -> float:
    """Seconds per call with calls issued back to back (one sync per round): sustained throughput, as in
    decode where launches queue up. Median over rounds."""
    for _ in range(3):
        fn()
    synchronize(device)
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        synchronize(device)
        per_call.append((time.perf_counter() - t0) / repeats)
    return statistics.median(per_call)


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
    """Dequant+matmul of one real-size K3 expert (3 x 3584x3072 MXFP4, 17.5 MB) against `tokens` inputs (with
    --kernels mlx: MLX's experts, one expert for `tokens` tokens and a decode layer's 16)."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    if expert_backend(dev.type) == "mlx":
        return bench_mlx_experts(tokens, repeats)
    if dt == torch.float32:
        exact_fp32()
    g = torch.Generator().manual_seed(0)
    mats = {name: MXFP4Weight(torch.randint(0, 256, (r, c // 2), dtype=torch.uint8, generator=g),
                              torch.randint(118, 122, (r, c // 32), dtype=torch.uint8, generator=g)).to(dev)
            for name, (r, c) in K3_EXPERT.items()}
    expert = ExpertWeights(mats["w1"], mats["w2"], mats["w3"])
    packed = sum(m.nbytes for m in mats.values())
    x = torch.randn(tokens, 3584, generator=g).to(dev, dt)
    w1 = mats["w1"]
    mxfp4_linear(x, w1)  # builds and self-checks the fast path
    t_matrix = _sustained_seconds(lambda: mxfp4_linear(x, w1), dev, repeats)
    cfg = parse_config(preset_config("k3-slice", 2))
    t_expert = _sustained_seconds(lambda: expert_ffn(cfg, expert, x), dev, repeats)
    fast = fast_path(dev.type)
    return {
        "bench": "mxfp4", "device": str(dev), "dtype": dtype, "tokens": tokens,
        "path": getattr(fast, "isa", type(fast).__name__) if fast is not None else "torch reference",
        "threads": torch.get_num_threads(),
        "matrix_ms": round(t_matrix * 1e3, 3),
        "matrix_packed_GBps": round(w1.nbytes / t_matrix / GB, 2),
        "expert_ms": round(t_expert * 1e3, 3),
        "expert_packed_GBps": round(packed / t_expert / GB, 2),
        "expert_bytes": packed,
    }


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
    return {"bench": "mxfp4", "path": f"mlx {mx.__version__} ({mx.default_device()})", "tokens": tokens,
            "expert_ms": round(t_expert * 1e3, 3), "expert_packed_GBps": round(expert_bytes / t_expert / GB, 2),
            "layer_experts": k, "layer_ms": round(t_layer * 1e3, 3),
            "layer_packed_GBps": round(k * expert_bytes / t_layer / GB, 2), "expert_bytes": expert_bytes}
