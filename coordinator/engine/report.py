"""One generation's numbers as the CLI prints them: a dict for `--json`, a line for people; and the prefill's
progress line."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any, TextIO

from deltafin.coordinator.engine.events import Finished, PrefillProgress
from deltafin.progress import Progress, fmt_bytes
from deltafin.runtime.worker_stats import StageStats

log = logging.getLogger("deltafin.progress")


class PrefillReporter:
    """The CLI's prefill line (a `progress` callback of Engine.run): the expert bytes read of those to read, which
    decide the time left (a forward of a few hundred tokens already reads nearly every expert); the tokens to go
    and those resumed from the prefix cache are said once at the start."""

    def __init__(self, stream: TextIO | None = None, enabled: bool = True):
        self.stream, self.enabled = stream, enabled
        self.bar: Progress | None = None

    def __call__(self, p: PrefillProgress) -> None:
        if self.bar is None:
            if p.finished:
                return
            cached = int(p.tokens_done)
            log.info("prefill: %d tokens to go%s, about %s of expert reads", p.tokens_total - cached,
                     f" ({cached} already in the cache)" if cached else "", fmt_bytes(p.bytes_total))
            self.bar = Progress(p.bytes_total, "prefill", unit="B", stream=self.stream, enabled=self.enabled)
        self.bar.update(p.bytes_done - self.bar.done)
        if p.finished:
            self.bar.close()
            self.bar = None

# what each worker reports (its Stats): a summary field -> (section of its StageStats or None, field)
WORKER_COUNTERS: dict[str, tuple[str | None, str]] = {
    "bytes_read": ("experts", "bytes_read"),  # off its disks, blocks included
    "expert_lookups": ("experts", "lookups"), "expert_hits": ("experts", "hits"),
    "io_wait_s": ("experts", "io_wait_s"),
    "own_expert_bytes": ("wide", "own_expert_bytes"),  # wide experts: experts read for its own layers ...
    "others_expert_bytes": ("wide", "others_expert_bytes"),  # ... and for other stages' layers
    "peer_wait_s": ("wide", "peer_wait_s"),  # its stage waiting for the other holders
    "calls_served": ("wide", "calls_served"), "served_s": ("wide", "served_s"),  # other stages' calls
    "forward_s": (None, "seconds"),  # in its stage's forwards
    "experts_s": (None, "experts_s"),  # of which producing the routed experts' outputs
    "handed_on": (None, "handed_on"),  # forwards whose states it handed to the next stage's worker
    "hand_offs_failed": (None, "hand_offs_failed"),  # ... that fell back to the coordinator's relay
    "handed_in": (None, "handed_in"),  # hand-offs it received
}


def counter(s: StageStats, section: str | None, name: str) -> Any:
    """A counter of a worker's stats, by its section (None: the stage's own) and field; None where the section is
    absent (experts resident, no wide experts) or the counter says nothing (a holder's wait on holders)."""
    source = getattr(s, section) if section else s
    return getattr(source, name) if source is not None else None


def worker_rows(stats: list[StageStats]) -> list[dict[str, Any]]:
    """Each worker's layers, share of the experts and counters (cumulative since it was assigned)."""
    rows = []
    for s in stats:
        row: dict[str, Any] = {"name": s.name or "?", "layers": list(s.layers),
                               "experts": s.wide.share if s.wide is not None else "its layers'"}
        for field, where in WORKER_COUNTERS.items():
            value = counter(s, *where)
            if value is not None:
                row[field] = round(value, 4) if isinstance(value, float) else value
        if s.disks:
            row["disks"] = [asdict(d) for d in s.disks]
        rows.append(row)
    return rows


def worker_deltas(before: list[StageStats], after: list[StageStats]) -> list[dict[str, Any]]:
    """worker_rows of `after` less those of `before`: what each worker did in between. A worker is its name, its
    layers and its place among those of the same name and layers (workers on one host share a name)."""
    old = dict(zip(_keys(before), worker_rows(before), strict=True))
    out = []
    for key, row in zip(_keys(after), worker_rows(after), strict=True):
        prior = old.get(key, {})
        delta = {k: (round(v - prior.get(k, 0), 4) if k in WORKER_COUNTERS else v) for k, v in row.items()}
        if "disks" in row:
            was = {d["dir"]: d for d in prior.get("disks", [])}
            delta["disks"] = [{**d, **{k: d[k] - was.get(d["dir"], {}).get(k, 0) for k in ("bytes_read", "reads")}}
                              for d in row["disks"]]
        out.append(delta)
    return out


def _keys(stats: list[StageStats]) -> list[tuple[str, tuple[int, int], int]]:
    seen: dict[tuple[str, tuple[int, int]], int] = {}
    keys = []
    for s in stats:
        base = (s.name or "?", s.layers)
        seen[base] = seen.get(base, 0) + 1
        keys.append((*base, seen[base]))
    return keys


def run_summary(finished: Finished, stats: list[StageStats], at_first: list[StageStats] | None = None
                ) -> dict[str, Any]:
    """One generation's numbers, with the workers' expert I/O counters (cumulative for their stages), and with
    `at_first` (their counters when the first token came) what each did while decoding (`decode_workers`)."""
    experts = [s.experts for s in stats if s.experts is not None]
    lookups = sum(e.lookups for e in experts)
    t = finished.timing
    return {"prompt_tokens": finished.usage.prompt_tokens, "completion_tokens": finished.usage.completion_tokens,
            "tok_per_s": t.tokens_per_second, "s_per_token": t.seconds_per_token, "prefill_s": t.prefill_s,
            "bytes_read": sum(e.bytes_read for e in experts),
            "hit_rate": sum(e.hits for e in experts) / lookups if lookups else None,
            "draft_tokens": finished.drafting.draft_tokens, "accepted_tokens": finished.drafting.accepted_tokens,
            "forwards": finished.drafting.forwards, "workers": worker_rows(stats),
            **({"decode_workers": worker_deltas(at_first, stats)} if at_first is not None else {})}


def format_summary(s: dict[str, Any]) -> str:
    hit = "all experts resident" if s["hit_rate"] is None else f"expert hit rate {s['hit_rate']:.1%}"
    drafts = (f", {s['accepted_tokens']}/{s['draft_tokens']} drafts taken in {s['forwards']} forwards"
              if s["draft_tokens"] else "")
    return (f"[{s['completion_tokens']} tokens, {s['tok_per_s']:.2f} tok/s, {s['s_per_token']:.3f} s/token, "
            f"prefill {s['prefill_s']:.2f} s, {s['bytes_read'] / 1e9:.3f} GB read, {hit}{drafts}]")
