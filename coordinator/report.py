"""One generation's numbers as the CLI prints them: a dict for `--json`, a line for people."""

from __future__ import annotations

from typing import Any


def run_summary(finished: Any, stats: list[dict[str, Any]]) -> dict[str, Any]:
    """One generation's numbers, with the workers' expert I/O counters (cumulative for their stages)."""
    experts = [s.get("experts", {}) for s in stats]
    lookups = sum(e.get("lookups", 0) for e in experts)
    t = finished.timing
    return {"prompt_tokens": finished.usage.prompt_tokens, "completion_tokens": finished.usage.completion_tokens,
            "tok_per_s": t.tokens_per_second, "s_per_token": t.seconds_per_token, "prefill_s": t.prefill_s,
            "bytes_read": sum(e.get("bytes_read", 0) for e in experts),
            "hit_rate": sum(e.get("hits", 0) for e in experts) / lookups if lookups else None,
            "draft_tokens": finished.drafting.draft_tokens, "accepted_tokens": finished.drafting.accepted_tokens,
            "forwards": finished.drafting.forwards}


def format_summary(s: dict[str, Any]) -> str:
    hit = "all experts resident" if s["hit_rate"] is None else f"expert hit rate {s['hit_rate']:.1%}"
    drafts = (f", {s['accepted_tokens']}/{s['draft_tokens']} drafts taken in {s['forwards']} forwards"
              if s["draft_tokens"] else "")
    return (f"[{s['completion_tokens']} tokens, {s['tok_per_s']:.2f} tok/s, {s['s_per_token']:.3f} s/token, "
            f"prefill {s['prefill_s']:.2f} s, {s['bytes_read'] / 1e9:.3f} GB read, {hit}{drafts}]")
