"""`GET /v1/status`: the server at a glance, as JSON for the web chat's cluster panel (and for scripts).

The model, uptime, the engine's counters, the requests whose prompts are prefilling and how far, and each
worker's layers, share of the experts, expert cache hit rate and bytes read. A pure function of what the
engine holds and the workers' stats, so tests give it known inputs; server.py gathers them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deltafin.coordinator.engine.engine import Counters, Prefilling
from deltafin.coordinator.engine.scheduler import SchedulerStats
from deltafin.runtime.worker_stats import StageStats


def status(model: str, uptime_s: float, counters: Counters, queue: SchedulerStats,
           prefilling: Iterable[Prefilling], workers: list[StageStats] | None, now: float,
           workers_error: str | None = None, context: int | None = None,
           reconnecting: dict[str, float] | None = None) -> dict[str, Any]:
    """`now`: the monotonic clock the prefills' `started` is on. `workers` None: their stats did not come
    (`workers_error` says why); the rest is still the coordinator's own. `context`: tokens a request may have.
    `reconnecting`: the plan's workers that stopped answering, asked again for how many seconds so far (recovery.py)."""
    return {"object": "status", "model": model, "context_length": context, "uptime_s": round(uptime_s, 1),
            "counters": _counters(counters),
            "queue": {"running": queue.active, "waiting": queue.waiting},
            "prefilling": [prefill_row(p, now) for p in prefilling],
            "workers": [worker_row(w) for w in workers or []],
            "workers_error": workers_error,
            "reconnecting": {name: round(s, 1) for name, s in (reconnecting or {}).items()}}


def _counters(c: Counters) -> dict[str, Any]:
    return {"requests": c.requests, "prompt_tokens": c.prompt_tokens, "generated_tokens": c.generated_tokens,
            "last_tokens_per_second": round(c.last_tokens_per_second, 3), "finished": dict(sorted(c.finished.items())),
            "cancelled": c.cancelled, "failed": c.failed}


def prefill_row(p: Prefilling, now: float) -> dict[str, Any]:
    """One prefill: tokens and expected expert bytes done of all, and the time left at the rate read so far (None
    until some bytes are read). `fraction` is of the bytes, which decide the time (engine.Prefilling)."""
    pp, elapsed = p.progress, max(0.0, now - p.started)
    rate = pp.bytes_done / elapsed if pp.bytes_done > 0 and elapsed > 0 else 0.0
    fraction = pp.bytes_done / pp.bytes_total if pp.bytes_total > 0 else pp.tokens_done / max(1, pp.tokens_total)
    return {"tokens_done": int(pp.tokens_done), "tokens_total": pp.tokens_total,
            "bytes_done": int(pp.bytes_done), "bytes_total": int(pp.bytes_total),
            "fraction": round(min(1.0, fraction), 4), "elapsed_s": round(elapsed, 1),
            "seconds_left": round((pp.bytes_total - pp.bytes_done) / rate, 1) if rate else None}


def worker_row(s: StageStats) -> dict[str, Any]:
    """A worker's stats as the panel shows them. `layers` [start, end) as the stats give them; `experts` its share
    with wide experts (None: its own layers'); `hit_rate` None where its experts are resident (nothing streams)."""
    experts = s.experts
    return {"name": s.name or "?", "layers": list(s.layers), "experts": s.wide.share if s.wide is not None else None,
            "hit_rate": round(experts.hit_rate, 4) if experts is not None else None,
            "expert_bytes_read": experts.bytes_read if experts is not None else 0,
            "spine_bytes_streamed": s.spine_streamed_bytes, "tokens": s.tokens, "sessions": s.sessions}
