"""Benchmarks that print JSON: MXFP4 kernel throughput and decode speed (`deltafin bench`).

Timed with the device synchronized, after warm-up; medians over repeats. The numbers go into the
closing notes and the README, never into timed unit tests.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deltafin.devices import exact_fp32, resolve_device, resolve_dtype, synchronize
from deltafin.quant import MXFP4Weight

K3_EXPERT = {"w1": (3072, 3584), "w2": (3584, 3072), "w3": (3072, 3584)}  # logical [rows, cols]


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


def bench_mxfp4(device: str = "auto", dtype: str = "fp32", tokens: int = 1, repeats: int = 20) -> dict[str, Any]:
    """Dequant+matmul of one real-size K3 expert (3 x 3584x3072 MXFP4, 17.5 MB) against `tokens` inputs."""
    from deltafin.config import parse_config
    from deltafin.kernels.linear import MXFP4_FAST_PATHS, mxfp4_linear
    from deltafin.models.moe import expert_ffn
    from deltafin.models.weights import ExpertWeights
    from deltafin.synth import preset_config

    dev, dt = resolve_device(device), resolve_dtype(dtype)
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
    fast = MXFP4_FAST_PATHS.get(dev.type)
    return {
        "bench": "mxfp4", "device": str(dev), "dtype": dtype, "tokens": tokens,
        "path": getattr(fast, "isa", type(fast).__name__) if fast is not None else "torch reference",
        "threads": torch.get_num_threads(),
        "matrix_ms": round(t_matrix * 1e3, 3),
        "matrix_packed_GBps": round(w1.nbytes / t_matrix / 1e9, 2),
        "expert_ms": round(t_expert * 1e3, 3),
        "expert_packed_GBps": round(packed / t_expert / 1e9, 2),
        "expert_bytes": packed,
    }


def bench_decode(model: str | Path, tokens: int = 32, prompt: int = 16, device: str = "auto",
                 dtype: str = "fp32") -> dict[str, Any]:
    """Greedy decode speed with every weight resident: ms per token (median), after a short prefill."""
    from deltafin.pipeline import LocalPipeline
    from deltafin.stage import SeqInput

    pipe = LocalPipeline.load(model, 1, device=device, dtype=dtype)
    try:
        cfg = pipe.config
        dev = pipe.stages[0].device
        ids = torch.arange(prompt) % (cfg.vocab_size - 256)
        t0 = time.perf_counter()
        logits = pipe.forward([SeqInput("bench", 0, ids=ids)])[0].logits
        synchronize(dev)
        t_prefill = time.perf_counter() - t0
        times, n = [], prompt
        for _ in range(tokens):
            nxt = logits[-1].argmax().view(1)
            t0 = time.perf_counter()
            logits = pipe.forward([SeqInput("bench", n, ids=nxt)])[0].logits
            synchronize(dev)
            times.append(time.perf_counter() - t0)
            n += 1
        return {
            "bench": "decode", "model": str(model), "device": str(dev), "dtype": dtype,
            "layers": cfg.num_layers, "hidden": cfg.hidden_size, "prompt_tokens": prompt,
            "prefill_s": round(t_prefill, 4), "tokens": tokens,
            "ms_per_token_median": round(statistics.median(times) * 1e3, 3),
            "ms_per_token_min": round(min(times) * 1e3, 3),
            "tok_per_s": round(1 / statistics.median(times), 2),
        }
    finally:
        pipe.close()
