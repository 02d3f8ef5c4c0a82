"""Measuring a worker's compute (plan/compute.py's ComputeSpeed) once at start, on its device, with the kernels its
stages run: a routed expert of the model's shapes and format (made of seeded random bytes: the time does not
depend on the values) through `expert_ffn` for one token and for PROMPT_ROWS, and a spine-shaped matrix through
`linear` in each spine format (deltafin/formats: as stored, row-int8, q4), for one token and for SPINE_ROWS. The
fastest of REPEATS runs each, after one to warm up (a fast path's first use builds and checks it). One to three
seconds on a 2-core CPU at K3's width; the worker announces the result and the plan prices every forward's compute
with it.

The MLX expert path (Apple silicon) batches a layer's experts through `gather_qmm`; this probe times the torch
path, which on a Mac is the slower one: there the prediction errs long.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from deltafin.checkpoint.config import ExpertFormat, ModelConfig
from deltafin.devices import synchronize
from deltafin.formats import spine_formats
from deltafin.kernels.linear import linear
from deltafin.kernels.quant import MXFP4Weight
from deltafin.models.moe import expert_ffn
from deltafin.models.weights import ExpertWeights
from deltafin.plan.compute import ComputeSpeed

log = logging.getLogger(__name__)

PROMPT_ROWS = 32  # tokens through an expert in the batched timing (a 4K prompt routes ~70 to each of K3's)
SPINE_ROWS = 512  # tokens through the spine-shaped matrix in the batched timing (a prompt's forward: hundreds)
SPINE_OUT = 1024  # its rows (its columns: the model's hidden size)
REPEATS = 2


def measure_compute(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> ComputeSpeed:
    """This worker's ComputeSpeed for `cfg` on `device` with activations in `dtype`."""
    gen = torch.Generator().manual_seed(0)
    expert = _expert(cfg, gen, device)
    one = torch.randn(1, cfg.expert_dim, generator=gen).to(device, dtype)
    many = torch.randn(PROMPT_ROWS, cfg.expert_dim, generator=gen).to(device, dtype)
    t1 = _fastest(lambda: expert_ffn(cfg, expert, one), device)
    tn = _fastest(lambda: expert_ffn(cfg, expert, many), device)
    d = cfg.hidden_size
    dense = (torch.randn(SPINE_OUT, d, generator=gen) / d ** 0.5).to(torch.bfloat16)
    weights = {f.name: f.quantize(dense).to(device) for f in spine_formats()}
    rates = []
    for rows in (1, SPINE_ROWS):
        x = torch.randn(rows, d, generator=gen).to(device, dtype)
        flop = 2.0 * rows * SPINE_OUT * d
        rates.append({fmt: flop / max(_fastest(lambda w=w, x=x: linear(x, w), device), 1e-9)
                      for fmt, w in weights.items()})
    speed = ComputeSpeed(t1, tn / PROMPT_ROWS, *rates)
    log.info("compute on %s: %s", device, speed.describe())
    return speed


def _expert(cfg: ModelConfig, gen: torch.Generator, device: torch.device) -> ExpertWeights:
    i, d = cfg.moe_intermediate_size, cfg.expert_dim

    def matrix(rows: int, cols: int) -> MXFP4Weight | torch.Tensor:
        if cfg.expert_format is ExpertFormat.MXFP4:
            packed = torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.uint8)
            scales = torch.randint(118, 124, (rows, cols // 32), generator=gen, dtype=torch.uint8)  # 2^-9..2^-4
            return MXFP4Weight(packed.to(device), scales.to(device))
        return (torch.randn(rows, cols, generator=gen) / cols ** 0.5).to(device, torch.bfloat16)

    return ExpertWeights(matrix(i, d), matrix(d, i), matrix(i, d))


def _fastest(run: Callable[[], torch.Tensor], device: torch.device) -> float:
    run()
    synchronize(device)
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        run()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best
