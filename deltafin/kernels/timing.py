"""Timing kernels the one way the benchmarks (`deltafin bench --kernel`) and a worker's compute probe
(runtime/compute_probe.py) both use, so that the plan's numbers and the benchmark's agree: calls issued back to back
with one synchronization per round (sustained throughput, as in decode, where launches queue up), several
candidates' rounds interleaved in a rotating order (a burst of load on a shared machine falls on every candidate
alike), the median of the rounds, and copies of a weight taken in turn (so that it comes from memory, not from a
cache that the stage's whole spine would never fit in).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltafin.devices import synchronize
from deltafin.formats import WeightFormat

WARMUP_CALLS = 3  # a fast path's first use builds and self-checks it


class Stopped(Exception):
    """A timing given up between rounds because its caller has other work (a worker's request came in)."""


@dataclass(frozen=True)
class Timed:
    """Each candidate's seconds a call (the median of its rounds) and how far the last rounds spread around it:
    (slowest - fastest) / median of each candidate's last `window` rounds, the largest over the candidates."""

    seconds: dict[str, float]
    spread: float
    rounds: int


def interleaved_seconds(fns: dict[str, Callable[[], object]], device: torch.device, repeats: int,
                        rounds: int) -> dict[str, float]:
    """Seconds a call of each fn: `rounds` rounds of `repeats` back-to-back calls, interleaved, median."""
    return stable_seconds(fns, device, repeats, min_rounds=rounds, max_rounds=rounds).seconds


def stable_seconds(fns: dict[str, Callable[[], object]], device: torch.device, repeats: int, *, min_rounds: int,
                   max_rounds: int, budget_s: float = math.inf, tolerance: float = 0.0, window: int = 3,
                   should_stop: Callable[[], bool] | None = None) -> Timed:
    """As interleaved_seconds, with rounds added (from `min_rounds` up to `max_rounds`, while `budget_s` lasts)
    until the last `window` rounds of every fn lie within `tolerance` of their median. `should_stop`, asked after
    each round: true gives the timing up (Stopped)."""
    for fn in fns.values():
        for _ in range(WARMUP_CALLS):
            fn()
    synchronize(device)
    names, per_call = list(fns), {name: [] for name in fns}
    start, k = time.perf_counter(), 0
    while True:
        for name in names[k % len(names):] + names[:k % len(names)]:
            t0 = time.perf_counter()
            for _ in range(repeats):
                fns[name]()
            synchronize(device)
            per_call[name].append((time.perf_counter() - t0) / repeats)
        k += 1
        if should_stop is not None and should_stop():
            raise Stopped(f"stopped after {k} rounds")
        spread = max(_spread(t[-window:]) for t in per_call.values())
        if k >= max_rounds or (k >= min_rounds and (spread <= tolerance or time.perf_counter() - start > budget_s)):
            return Timed({name: statistics.median(t) for name, t in per_call.items()}, spread, k)


def _spread(times: list[float]) -> float:
    return (max(times) - min(times)) / max(statistics.median(times), 1e-12)


def weight_bytes(w: object) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes


def copies(w: object, total_bytes: int, most: int = 64) -> list:
    """`w` and copies of it, as many as add up to `total_bytes` (at most `most`): taken in turn, they come from
    memory."""
    n = min(most, max(1, math.ceil(total_bytes / weight_bytes(w))))
    clone = (lambda: w.clone()) if isinstance(w, torch.Tensor) else \
        (lambda: type(w)(*(a.clone() for a in WeightFormat.arrays(w))))
    return [w] + [clone() for _ in range(n - 1)]


def in_turn(call: Callable[[object], torch.Tensor], weights: list) -> Callable[[], torch.Tensor]:
    """A call of `call` on the next of `weights`, round and round."""
    ring = itertools.cycle(weights)
    return lambda: call(next(ring))
