"""How fast this disk serves the reads the runtime makes: the expert reader itself (aligned slots, its
threads, direct I/O or not) over real read plans. `deltafin bench --disk` and `bench --model` report it;
a worker measures a quick sample at start and announces it (the planner weighs stages by it)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from typing import Any

from deltafin.weights.reader import DEMAND, ExpertReader, ReadPlan, ShardFiles, SlotPool, plan_read

GB = 1e9


def measure_reads(plans: list[ReadPlan], io: str, threads: int) -> dict[str, Any]:
    """Read every plan with the runtime's reader (aligned slots, `threads` readers); GB/s of bytes read."""
    files = ShardFiles(io)
    reader = ExpertReader(files, threads=threads)
    pool = SlotPool(2 * threads, max(p.span for p in plans))
    try:
        t0 = time.perf_counter()
        futures = [reader.submit((0, DEMAND), p, pool, lambda slot, plan: pool.release(slot)) for p in plans]
        for f in futures:
            f.result()
        seconds = time.perf_counter() - t0
    finally:
        reader.close()
        files.close()
    return {"disk_GBps": round(files.stats.bytes_read / seconds / GB, 3), "read_bytes": files.stats.bytes_read,
            "reads": files.stats.reads, "read_size": max(p.span for p in plans), "threads": threads, "io": io,
            "direct_io_in_effect": files.direct_in_effect, "seconds": round(seconds, 3)}


def expert_read_speed(ckpt: Any, layers: Iterable[int], threads: int, io: str, total_bytes: int = 3 * 10**9,
                      seed: int = 1) -> dict[str, Any]:
    """The disk as the expert store sees it: distinct random whole experts of these layers, about
    `total_bytes` of them (8 at least)."""
    rng = random.Random(seed)
    keys = [(layer, e) for layer in layers for e in range(ckpt.config.num_experts)]
    rng.shuffle(keys)
    count = max(8, min(len(keys), total_bytes // ckpt.config.bytes_per_expert))
    return measure_reads([plan_read(ckpt.expert(*k)) for k in keys[:count]], io, threads)


def measure_disk(ckpt: Any, threads: int, io: str, budget_bytes: int = 256 << 20) -> float:
    """GB/s of whole-expert reads from `ckpt`'s disk with the runtime's reader (a quick sample, at a worker's
    start; `deltafin bench --disk` measures properly). 0 when it holds no MoE layer."""
    layers = [layer for layer in ckpt.layers_available() if ckpt.config.is_moe(layer)]
    if not layers:
        return 0.0
    return expert_read_speed(ckpt, layers, threads, io, total_bytes=budget_bytes, seed=0)["disk_GBps"]
