"""`deltafin-coordinator ... bench`: N concurrent requests through the serving engine, as a server would
run them, for each N asked: aggregate and per-request speed, and how busy every stage was.

Each request has its own seeded random prompt (no two share a prefix, so the prefix cache does not flatter
the numbers) and generates exactly `max_tokens` tokens (the stop tokens are ignored). A stage's utilization
is the time its forwards took (the worker's own clock) over the wall time of the level: with one batch in
flight the stages of a cluster take turns and their utilizations add up to at most 1; with one batch per
stage in flight they can all approach 1.

With `long_prompt` T, each level also starts one request with a T-token prompt (and one generated token)
next to the N streams: its time to first token and the streams' speed while it prefills show what a new
long prompt costs running streams (`--prefill-batches ride|separate`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from deltafin.coordinator.engine.engine import Engine
from deltafin.coordinator.engine.events import Finished
from deltafin.coordinator.engine.generation import Generation
from deltafin.coordinator.engine.report import worker_deltas
from deltafin.runtime.worker_stats import StageStats


@dataclass(frozen=True)
class RequestResult:
    ttft_s: float
    tokens: int
    decode_tok_per_s: float


async def _one(engine: Engine, prompt: list[int], max_tokens: int,
               started: asyncio.Semaphore | None = None) -> RequestResult:
    t0, ttft, tokens, rate = time.perf_counter(), 0.0, 0, 0.0
    async for event in engine.run(prompt, None, Generation(max_tokens, ignore_eos=True)):
        if isinstance(event, Finished):
            rate = event.timing.tokens_per_second
        else:
            tokens += 1
            if not ttft and started is not None:
                started.release()
            ttft = ttft or time.perf_counter() - t0
    return RequestResult(ttft, tokens, rate)


def _busy(stats: list[StageStats]) -> dict[str, tuple[list[int], float]]:
    return {s.name or f"stage-{i}": (list(s.layers), s.seconds) for i, s in enumerate(stats)}


async def bench_level(engine: Engine, concurrency: int, prompt_tokens: int, max_tokens: int,
                      seed: int, long_prompt: int = 0) -> dict[str, Any]:
    rng = torch.Generator().manual_seed(seed)
    vocab = engine.cfg.vocab_size - 256  # plain tokens, below the specials
    prompts = [torch.randint(0, vocab, (prompt_tokens,), generator=rng).tolist() for _ in range(concurrency)]
    long = torch.randint(0, vocab, (long_prompt,), generator=rng).tolist() if long_prompt else None
    first = await engine.worker_stats()
    before, sched = _busy(first), asdict(engine.scheduler.stats)
    engine.scheduler.stats.max_in_flight = 0
    t0 = time.perf_counter()
    started = asyncio.Semaphore(0)  # a stream's first token releases it once
    streams = asyncio.gather(*(_one(engine, p, max_tokens, started) for p in prompts))
    late = None
    if long is not None:
        for _ in prompts:  # the long prompt arrives once every stream is decoding
            await started.acquire()
        late = await _one(engine, long, 1)
    results = await streams
    wall = time.perf_counter() - t0
    last = await engine.worker_stats()
    after = _busy(last)
    stages = [{"worker": name, "layers": layers, "busy_s": round(busy - before.get(name, ([], 0.0))[1], 3),
               "utilization": round((busy - before.get(name, ([], 0.0))[1]) / wall, 3)}
              for name, (layers, busy) in after.items()]
    tokens = sum(r.tokens for r in results)
    s = engine.scheduler.stats
    return {"concurrency": concurrency, "wall_s": round(wall, 4), "tokens": tokens,
            "aggregate_tok_per_s": round(tokens / wall, 3),
            "per_request_tok_per_s": round(sum(r.decode_tok_per_s for r in results) / len(results), 3),
            "slowest_request_tok_per_s": round(min(r.decode_tok_per_s for r in results), 3),
            "ttft_s": round(sum(r.ttft_s for r in results) / len(results), 3),
            "batches": s.batches - sched["batches"],
            "sequences_per_batch": round((s.batched_sequences - sched["batched_sequences"])
                                         / max(1, s.batches - sched["batches"]), 2),
            "max_batches_in_flight": s.max_in_flight, "stages": stages, "workers": worker_deltas(first, last),
            **({"long_prompt_tokens": long_prompt, "long_prompt_ttft_s": round(late.ttft_s, 3)} if late else {})}


async def bench_serving(engine: Engine, levels: list[int], prompt_tokens: int, max_tokens: int,
                        seed: int = 0, long_prompt: int = 0) -> dict[str, Any]:
    if max(levels) + bool(long_prompt) > engine.scheduler.max_active:
        raise ValueError(f"concurrency {max(levels)} (and the long prompt, if any) is more than --max-active "
                         f"{engine.scheduler.max_active}")
    await _one(engine, [5, 6, 7, 8], 2)  # warm-up: first-call costs on every stage
    out = []
    for i, n in enumerate(levels):
        out.append(await bench_level(engine, n, prompt_tokens, max_tokens, seed + i, long_prompt))
    return {"bench": "serving", "model": engine.model_name, "pipeline_depth": engine.scheduler.pipeline_depth,
            "prefill_batches": "ride" if engine.scheduler.ride else "separate",
            "stages": len(engine.backend.prefix_stages), "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            "levels": out}
