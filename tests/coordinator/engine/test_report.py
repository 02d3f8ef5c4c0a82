"""The CLI's prefill line: bytes read of the bytes to read (the time left), tokens to go and resumed said once."""

from __future__ import annotations

import io
import logging

from deltafin.coordinator.engine.events import PrefillProgress
from deltafin.coordinator.engine.report import PrefillReporter


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_prefill_line_counts_bytes_of_what_is_left_and_closes(caplog) -> None:
    stream = _Terminal()  # on a terminal the line is redrawn, and closed with the final count
    report = PrefillReporter(stream=stream)
    with caplog.at_level(logging.INFO, logger="deltafin.progress"):
        report(PrefillProgress(4000, 10000, 0, 2e12))  # 4000 resumed from the prefix cache
        report(PrefillProgress(6000, 10000, 1e12, 2e12))
        assert report.bar is not None and report.bar.total == 2e12 and report.bar.done == 1e12
        report(PrefillProgress(10000, 10000, 2e12, 2e12))
    assert report.bar is None
    assert "6000 tokens to go (4000 already in the cache), about 2.0 TB of expert reads" in caplog.text
    assert stream.getvalue().endswith("\n") and "100.0% 2.0 TB / 2.0 TB" in stream.getvalue()
    quiet = PrefillReporter(stream=io.StringIO())
    quiet(PrefillProgress(10, 10, 0, 0))  # nothing to prefill (all resumed): no line at all
    assert quiet.bar is None


def test_decode_counters_are_each_worker_s_own_when_workers_share_a_host_name() -> None:
    """Two workers on one host (the same name): each one's counters less its own earlier ones, never another's
    (seen on the H200: one worker's decode counters came out negative)."""
    from deltafin.coordinator.engine.report import worker_deltas

    def stats(a: int, b: int) -> list[dict]:
        return [{"name": "vm", "layers": [0, 45], "experts": {"bytes_read": a, "lookups": a // 10}},
                {"name": "vm", "layers": [45, 93], "experts": {"bytes_read": b, "lookups": b // 10}}]

    rows = worker_deltas(stats(1000, 5000), stats(1300, 5200))
    assert [(r["layers"], r["bytes_read"], r["expert_lookups"]) for r in rows] == [([0, 45], 300, 30),
                                                                                  ([45, 93], 200, 20)]
