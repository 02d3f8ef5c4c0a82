"""`/metrics` in the Prometheus text format (version 0.0.4): the engine's counters and each worker's."""

from __future__ import annotations

import time
from typing import Any

from deltafin.coordinator.engine.engine import Engine
from deltafin.coordinator.engine.report import counter
from deltafin.runtime.worker_stats import StageStats


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_: str, samples: list[tuple[dict[str, Any], float]]) -> None:
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        for labels, value in samples:
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{inner}}} {float(value)!r}" if inner else f"{name} {float(value)!r}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(engine: Engine, workers: list[StageStats], requests: dict[tuple[str, int], int]) -> str:
    w = _Writer()
    w.metric("deltafin_http_requests_total", "counter", "HTTP requests by route and status.",
             [({"route": r, "status": st}, n) for (r, st), n in sorted(requests.items())])
    _generations(w, engine)
    _prefills(w, engine)
    _scheduling(w, engine)
    if engine.prefixes is not None:
        _prefixes(w, engine)
    _workers(w, workers)
    return w.text()


def _generations(w: _Writer, engine: Engine) -> None:
    c = engine.counters
    w.metric("deltafin_generations_total", "counter", "Generations by outcome.",
             [({"outcome": reason}, n) for reason, n in sorted(c.finished.items())]
             + [({"outcome": "cancelled"}, c.cancelled), ({"outcome": "failed"}, c.failed)])
    w.metric("deltafin_prompt_tokens_total", "counter", "Prompt tokens prefilled.", [({}, c.prompt_tokens)])
    w.metric("deltafin_generated_tokens_total", "counter", "Tokens generated.", [({}, c.generated_tokens)])
    w.metric("deltafin_decode_seconds_total", "counter", "Seconds spent in decode steps.", [({}, c.decode_seconds)])
    w.metric("deltafin_decode_steps_total", "counter", "Decode steps (forwards after the prefill).",
             [({}, c.decode_steps)])
    w.metric("deltafin_decode_tokens_per_second", "gauge", "Decode speed of the last finished generation.",
             [({}, c.last_tokens_per_second)])
    w.metric("deltafin_draft_tokens_total", "counter", "Drafted tokens verified (speculative decoding).",
             [({}, c.draft_tokens)])
    w.metric("deltafin_accepted_tokens_total", "counter", "Drafted tokens taken.", [({}, c.accepted_tokens)])
    w.metric("deltafin_decode_forwards_total", "counter", "Forwards after the prefills (one per token without "
             "drafting).", [({}, c.forwards)])


def _prefills(w: _Writer, engine: Engine) -> None:
    now = time.monotonic()
    pre = list(engine.prefilling.values())
    w.metric("deltafin_prefill_requests", "gauge", "Requests whose prompt is being prefilled.", [({}, len(pre))])
    w.metric("deltafin_prefill_tokens_done", "gauge", "Prompt tokens in the caches of those requests.",
             [({}, round(sum(p.done for p in pre)))])
    w.metric("deltafin_prefill_tokens_left", "gauge", "Prompt tokens those requests still have to prefill.",
             [({}, round(sum(p.total - p.done for p in pre)))])
    w.metric("deltafin_prefill_oldest_seconds", "gauge", "How long the longest-running prefill has been going.",
             [({}, max((now - p.started for p in pre), default=0.0))])
    w.metric("deltafin_prefill_bytes_done", "gauge", "Expert bytes those prefills have read (expected: a uniform "
             "router's).", [({}, sum(p.progress.bytes_done for p in pre))])
    w.metric("deltafin_prefill_bytes_left", "gauge", "Expert bytes they still have to read.",
             [({}, sum(p.progress.bytes_total - p.progress.bytes_done for p in pre))])
    w.metric("deltafin_prefill_seconds_left", "gauge", "The longest time left of a prefill: its bytes still to read "
             "at the rate it has read them (0 until it has read some).",
             [({}, max((p.seconds_left or 0.0 for p in pre), default=0.0))])


def _scheduling(w: _Writer, engine: Engine) -> None:
    s = engine.scheduler.stats
    w.metric("deltafin_requests_running", "gauge", "Requests holding a slot.", [({}, s.active)])
    w.metric("deltafin_requests_waiting", "gauge", "Requests queued for a slot.", [({}, s.waiting)])
    w.metric("deltafin_batches_total", "counter", "Forward batches sent to the stages.", [({}, s.batches)])
    w.metric("deltafin_batched_sequences_total", "counter", "Sequences in those batches.",
             [({}, s.batched_sequences)])
    recoveries = getattr(engine.backend, "recoveries", [])
    w.metric("deltafin_cluster_recoveries_total", "counter", "Re-plans or replays after a worker failed.",
             [({}, len(recoveries))])
    w.metric("deltafin_cluster_last_recovery_seconds", "gauge", "Duration of the last recovery (re-plan and "
             "stage loads; replay comes after).", [({}, recoveries[-1].seconds if recoveries else 0.0)])


def _prefixes(w: _Writer, engine: Engine) -> None:
    index = engine.prefixes
    assert index is not None
    pc = index.counters
    w.metric("deltafin_prefix_lookups_total", "counter", "Requests that looked for a kept prefix of their prompt.",
             [({}, pc.lookups)])
    w.metric("deltafin_prefix_hits_total", "counter", "Requests that resumed from a kept prefix.", [({}, pc.hits)])
    w.metric("deltafin_prefix_tokens_saved_total", "counter", "Prompt tokens resumed instead of prefilled.",
             [({}, pc.tokens_saved)])
    w.metric("deltafin_prefix_whole_hits_total", "counter", "Requests whose whole prompt was kept (no prompt token "
             "fed).", [({}, pc.whole)])
    w.metric("deltafin_prefix_kept_total", "counter", "States kept (message ends, breakpoints, grid points, "
             "prompts' and requests' ends).", [({}, pc.kept)])
    w.metric("deltafin_prefix_entries", "gauge", "Prefixes the stages keep.", [({}, len(index.entries))])
    w.metric("deltafin_prefix_evicted_total", "counter", "Kept prefixes dropped for room.", [({}, pc.evicted)])
    w.metric("deltafin_prefix_missing_total", "counter", "Kept prefixes a stage no longer had (the request "
             "prefilled from the start).", [({}, pc.missing)])


# name, type, help, where in a worker's StageStats ((section, field): section None for the stage's own, "experts"
# where they stream, "wide" with wide experts)
_WORKER_METRICS: list[tuple[str, str, str, tuple[str | None, str]]] = [
    ("tokens_total", "counter", "Tokens through each worker's stage.", (None, "tokens")),
    ("sessions", "gauge", "Open sessions (sequence caches) on each worker.", (None, "sessions")),
    ("session_bytes", "gauge", "Bytes held by session caches.", (None, "session_bytes")),
    ("prefix_bytes", "gauge", "Bytes held by kept prefixes in memory.", (None, "prefix_bytes")),
    ("prefix_disk_bytes", "gauge", "Bytes held by kept prefixes on the disk.", (None, "prefix_disk_bytes")),
    ("expert_bytes_read_total", "counter", "Expert bytes read from the disk.", ("experts", "bytes_read")),
    ("spine_bytes_streamed_total", "counter", "Non-expert weight bytes streamed.", (None, "spine_streamed_bytes")),
    ("expert_lookups_total", "counter", "Routed-expert lookups.", ("experts", "lookups")),
    ("expert_hits_total", "counter", "Routed-expert lookups served from memory.", ("experts", "hits")),
    ("expert_hit_rate", "gauge", "Expert cache hit rate since the stage was loaded.", ("experts", "hit_rate")),
    ("own_expert_bytes_total", "counter", "Wide experts: expert bytes read for the worker's own layers.",
     ("wide", "own_expert_bytes")),
    ("others_expert_bytes_total", "counter", "Wide experts: expert bytes read for other stages' layers.",
     ("wide", "others_expert_bytes")),
    ("others_expert_hits_total", "counter", "Wide experts: other stages' lookups served from memory.",
     ("wide", "others_hits")),
    ("peer_wait_seconds_total", "counter", "Wide experts: seconds the worker's stage waited for other holders.",
     ("wide", "peer_wait_s")),
    ("expert_calls_served_total", "counter", "Wide experts: other stages' expert calls computed.",
     ("wide", "calls_served")),
    ("expert_served_seconds_total", "counter", "Wide experts: seconds spent computing other stages' calls.",
     ("wide", "served_s")),
]


def _workers(w: _Writer, workers: list[StageStats]) -> None:
    """Each worker's counters; expert ones only where its experts stream (resident experts have none), wide ones
    only with wide experts (a holder without a stage has no wait on holders)."""
    for name, kind, help_, where in _WORKER_METRICS:
        samples = [({"worker": s.name or "?"}, value) for s in workers if (value := counter(s, *where)) is not None]
        w.metric(f"deltafin_worker_{name}", kind, help_, samples)
