"""Measuring a worker's compute (plan/cluster/compute.py's ComputeSpeed) on its device, with the code its stages run,
timed as `deltafin bench --kernel` times it (kernels/timing.py: back-to-back calls, interleaved rounds, medians, copies
of
each weight taken in turn so that it comes from memory):

- a routed expert of the model's shapes and format (seeded random bytes: the time does not depend on the values)
  for one token and for PROMPT_ROWS, on the stage's expert backend (the torch fast paths, or MLX's `gather_qmm`);
- the model's widest spine matrix (`probe_matrix`) through `linear` in each spine format, held as a stage of that
  format holds it (deltafin/formats' `held_format`: q4 keeps a matrix of no whole groups row-int8), for one token
  and for SPINE_ROWS.

Rounds are added until the last ones agree within TOLERANCE or BUDGET_S runs out; what is left over is the
reading's `spread`, which the plan weighs where two modes come close. A one-token rate is bounded by CEILING times
the device's memory speed (measured here by a copy): a stage's spine does not fit in a cache. `ComputeReadings`
keeps a worker's readings (at start, then while it is idle) and announces their median, so one busy moment does not
set the plan.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deltafin.checkpoint.config import ExpertFormat, ModelConfig, TensorSpec
from deltafin.devices import synchronize
from deltafin.formats import held_format, spine_format, spine_formats, stored_spine
from deltafin.kernels.linear import expert_backend, linear
from deltafin.kernels.mlx_moe import MLXSlots, run_experts
from deltafin.kernels.quant import MXFP4Weight
from deltafin.kernels.timing import copies, in_turn, stable_seconds
from deltafin.models.common import activation
from deltafin.models.moe import expert_ffn
from deltafin.models.weights import ExpertWeights
from deltafin.plan.cluster.compute import ComputeSpeed
from deltafin.plan.memory.layer_table import tensor_role

log = logging.getLogger(__name__)

PROMPT_ROWS = 32  # tokens through an expert in the batched timing (a 4K prompt routes ~70 to each of K3's)
SPINE_ROWS = 512  # tokens through the spine matrix in the batched timing (a prompt's forward: hundreds)
CPU_BATCHED_OUT = 1024  # the CPU's batched timing takes this many of the matrix's rows: it is bound by FLOP there,
# not bytes, and the whole matrix would take seconds a call
ROTATION_BYTES = 128 * 10**6  # each weight's copies taken in turn: past a last-level cache (an H200's 50 MB, an M1
# Max's 48); at K3's width the probe holds ~0.5 GB while it runs, within the runtime's share of a plan (1.07 GB)
TOLERANCE = 0.10  # the last rounds of every candidate within 10 % of their median: stable
MIN_ROUNDS, MAX_ROUNDS = 5, 12  # as bench --kernel's 5 rounds, more where they disagree
ONE_TOKEN_CALLS = 16  # back-to-back one-token calls a round (decode queues its launches)
BUDGET_S = 3.0  # a phase's rounds stop adding after this long, stable or not
KEEP_READINGS = 5  # ComputeReadings' window
CEILING = 2.0  # a one-token rate is cut to this many times what the measured memory speed feeds (a copy's speed is
# within a few % of a matvec's reads on the 2-core x86 server: the margin is for noise, not for a cache's speed-up)


def measure_compute(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                    should_stop: Callable[[], bool] | None = None) -> ComputeSpeed:
    """This worker's ComputeSpeed for `cfg` on `device` with activations in `dtype` (see the module docstring).
    `should_stop`, asked between rounds: true gives the reading up (kernels/timing.Stopped), so that a request that
    comes in while an idle worker measures waits a round, not the whole probe."""
    gen = torch.Generator().manual_seed(0)
    rounds = {"min_rounds": MIN_ROUNDS, "max_rounds": MAX_ROUNDS, "budget_s": BUDGET_S, "tolerance": TOLERANCE,
              "should_stop": should_stop}
    t1, tn, expert_spread = _time_expert(cfg, device, dtype, gen, rounds)
    one, many, spine_spread = _time_spine(cfg, device, dtype, gen, rounds)
    speed = ComputeSpeed(t1, tn / PROMPT_ROWS, one, many, spread=max(expert_spread, spine_spread))
    log.info("compute on %s: %s", device, speed.describe())
    return speed


def probe_matrix(cfg: ModelConfig) -> TensorSpec:
    """The spine matrix the probe times: the first MoE layer's (else layer 0's) widest matrix that reads the
    hidden state, of those a spine format rounds."""
    layer = cfg.moe_layers[0] if cfg.moe_layers else 0
    specs = [s for s in cfg.layer_tensor_specs(layer) if len(s.shape) == 2 and min(s.shape) > 1]
    rounded = [s for s in specs if tensor_role(s) == "matrix" and s.shape[1] == cfg.hidden_size] or specs
    return max(rounded, key=lambda s: s.shape[0] * s.shape[1])


def _time_spine(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, gen: torch.Generator,
                rounds: dict) -> tuple[dict[str, float], dict[str, float], float]:
    """FLOP/s of each spine format for one token and for SPINE_ROWS, and the spread of the two timings."""
    spec = probe_matrix(cfg)
    rows, cols = spec.shape
    dense = (torch.randn(rows, cols, generator=gen) / cols ** 0.5).to(torch.bfloat16)
    held = {f.name: held_format(f.name, "matrix", spec.shape) for f in spine_formats()}
    for name, fmt in held.items():
        if fmt is not None and fmt.name != name:
            log.info("probe: a %s spine holds a %dx%d matrix as %s (%s's groups do not divide its rows)", name, rows,
                     cols, fmt.name, name)
    weights = {name: (fmt.quantize(dense) if fmt is not None else dense).to(device) for name, fmt in held.items()}
    out = min(rows, CPU_BATCHED_OUT) if device.type == "cpu" else rows
    sliced = weights if out == rows else {name: (fmt.quantize(dense[:out]) if fmt is not None else dense[:out]).to(
        device) for name, fmt in held.items()}
    del dense
    x1 = torch.randn(1, cols, generator=gen).to(device, dtype)
    rings = {name: copies(w, ROTATION_BYTES) for name, w in weights.items()}
    one = stable_seconds({name: in_turn(lambda w: linear(x1, w), ring) for name, ring in rings.items()}, device,
                         repeats=ONE_TOKEN_CALLS, **rounds)
    del rings, weights
    xn = torch.randn(SPINE_ROWS, cols, generator=gen).to(device, dtype)
    many = stable_seconds({name: (lambda w=w: linear(xn, w)) for name, w in sliced.items()}, device, repeats=1,
                          **rounds)
    ceiling = _memory_bytes_per_s(device)
    bytes_per_weight = {name: (fmt or spine_format(stored_spine())).bytes_per_weight for name, fmt in held.items()}
    one_rate = {name: min(2.0 * rows * cols / max(t, 1e-12), CEILING * 2.0 * ceiling / bytes_per_weight[name])
                for name, t in one.seconds.items()}
    many_rate = {name: 2.0 * SPINE_ROWS * out * cols / max(t, 1e-12) for name, t in many.seconds.items()}
    return one_rate, many_rate, max(one.spread, many.spread)


def _time_expert(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, gen: torch.Generator,
                 rounds: dict) -> tuple[float, float, float]:
    """Seconds of one routed expert for one token and for PROMPT_ROWS tokens, on the stage's expert backend."""
    x = torch.randn(PROMPT_ROWS, cfg.expert_dim, generator=gen)
    if expert_backend(device.type) == "mlx" and cfg.expert_format is ExpertFormat.MXFP4:
        calls = _mlx_expert_calls(cfg, x, gen)
        device = torch.device("cpu")  # an MLX evaluation returns when done
    else:
        count = min(16, max(1, ROTATION_BYTES // max(cfg.bytes_per_expert, 1)))
        experts = [_expert(cfg, gen, device) for _ in range(count)]  # taken in turn, as a layer's are
        one, many = x[:1].to(device, dtype), x.to(device, dtype)
        calls = {"one": in_turn(lambda e: expert_ffn(cfg, e, one), experts),
                 "many": in_turn(lambda e: expert_ffn(cfg, e, many), experts)}
    timed = stable_seconds(calls, device, repeats=4, **rounds)
    return timed.seconds["one"], timed.seconds["many"], timed.spread


def _mlx_expert_calls(cfg: ModelConfig, x: torch.Tensor, gen: torch.Generator) -> dict:
    """One expert through MLX's path (kernels/mlx_moe.py), for one token and for all of `x`'s."""
    slots = MLXSlots(cfg, 1)
    for j, region in enumerate(slots.regions(0)):  # random codes; scales near 2**-8 (valid E8M0)
        low, high = (0, 256) if j % 2 == 0 else (118, 122)
        region[:] = torch.randint(low, high, (len(region),), generator=gen, dtype=torch.uint8).numpy().tobytes()
    act = activation(cfg)
    run = lambda z: run_experts(slots, act, z, torch.zeros(len(z), 1, dtype=torch.long), torch.ones(len(z), 1),
                                lambda e: 0)
    one = x[:1]
    return {"one": lambda: run(one), "many": lambda: run(x)}


def _expert(cfg: ModelConfig, gen: torch.Generator, device: torch.device) -> ExpertWeights:
    i, d = cfg.moe_intermediate_size, cfg.expert_dim

    def matrix(rows: int, cols: int) -> MXFP4Weight | torch.Tensor:
        if cfg.expert_format is ExpertFormat.MXFP4:
            packed = torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.uint8)
            scales = torch.randint(118, 124, (rows, cols // 32), generator=gen, dtype=torch.uint8)  # 2^-9..2^-4
            return MXFP4Weight(packed.to(device), scales.to(device))
        return (torch.randn(rows, cols, generator=gen) / cols ** 0.5).to(device, torch.bfloat16)

    return ExpertWeights(matrix(i, d), matrix(d, i), matrix(i, d))


def _memory_bytes_per_s(device: torch.device) -> float:
    """The device's memory speed, as a copy of ROTATION_BYTES reads and writes it (the best of three)."""
    src = torch.empty(ROTATION_BYTES // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * ROTATION_BYTES / best


@dataclass
class ComputeReadings:
    """A worker's compute readings, the last KEEP_READINGS of them; `speed` is their median, field by field."""

    readings: list[ComputeSpeed] = field(default_factory=list)

    def add(self, reading: ComputeSpeed) -> ComputeSpeed:
        self.readings = [*self.readings, reading][-KEEP_READINGS:]
        return self.speed

    @property
    def speed(self) -> ComputeSpeed:
        rs = self.readings
        if len(rs) == 1:
            return rs[0]
        fmts = set.intersection(*(set(r.spine_one) for r in rs))
        med = statistics.median
        return ComputeSpeed(med(r.expert_one_s for r in rs), med(r.expert_token_s for r in rs),
                            {f: med(r.spine_one[f] for r in rs) for f in sorted(fmts)},
                            {f: med(r.spine_many[f] for r in rs) for f in sorted(fmts)},
                            spread=_between(rs))


def _between(rs: list[ComputeSpeed]) -> float:
    """The readings' uncertainty: the larger of their own spreads' median and how far they disagree (the decode
    expert time's (slowest - fastest) / median)."""
    times = [r.expert_one_s for r in rs]
    apart = (max(times) - min(times)) / max(statistics.median(times), 1e-12)
    return max(statistics.median(r.spread for r in rs), apart)
