"""The CLI's prefill line (bytes read of the bytes to read: the time left; tokens to go and resumed said once), and
the workers' rows of a run's summary from their typed stats."""

from __future__ import annotations

import io
import logging

from deltafin.coordinator.engine.events import PrefillProgress
from deltafin.coordinator.engine.report import PrefillReporter
from deltafin.runtime.worker_stats import StageStats, WideStats
from deltafin.weights.expert_stats import DiskStats, ExpertStats


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

    def stats(a: int, b: int) -> list[StageStats]:
        return [StageStats(name="vm", layers=(0, 45), experts=ExpertStats(bytes_read=a, lookups=a // 10)),
                StageStats(name="vm", layers=(45, 93), experts=ExpertStats(bytes_read=b, lookups=b // 10))]

    rows = worker_deltas(stats(1000, 5000), stats(1300, 5200))
    assert [(r["layers"], r["bytes_read"], r["expert_lookups"]) for r in rows] == [([0, 45], 300, 30),
                                                                                  ([45, 93], 200, 20)]


def test_worker_rows_read_each_section_where_a_worker_has_it() -> None:
    """A wide stage (experts streamed from two disks, calls to holders), an expert holder (no stage: no wait on
    holders) and a stage whose experts are resident (no expert counters): each row says what its worker has."""
    from deltafin.coordinator.engine.report import worker_rows

    disks = (DiskStats("/ssd", 3.0, 700, 7), DiskStats("/usb", 1.0, 300, 3))
    stage = StageStats(name="mac1", layers=(0, 47), seconds=2.5, experts_s=1.25, handed_on=4, disks=disks,
                       experts=ExpertStats(lookups=40, hits=30, bytes_read=1000, io_wait_s=0.5),
                       wide=WideStats("0-447x92", own_expert_bytes=600, others_expert_bytes=400, calls_served=3,
                                      served_s=0.75, peer_wait_s=0.125))
    holder = StageStats(name="mac3", experts=ExpertStats(bytes_read=80), wide=WideStats("448-895x92", calls_served=9))
    resident = StageStats(name="local-0", layers=(0, 6), seconds=1.0)
    wide_row, holder_row, resident_row = worker_rows([stage, holder, resident])
    assert wide_row == {"name": "mac1", "layers": [0, 47], "experts": "0-447x92", "bytes_read": 1000,
                        "expert_lookups": 40, "expert_hits": 30, "io_wait_s": 0.5, "own_expert_bytes": 600,
                        "others_expert_bytes": 400, "peer_wait_s": 0.125, "calls_served": 3, "served_s": 0.75,
                        "forward_s": 2.5, "experts_s": 1.25, "handed_on": 4, "hand_offs_failed": 0, "handed_in": 0,
                        "disks": [{"dir": "/ssd", "gbps": 3.0, "bytes_read": 700, "reads": 7},
                                  {"dir": "/usb", "gbps": 1.0, "bytes_read": 300, "reads": 3}]}
    assert holder_row["layers"] == [0, 0] and "peer_wait_s" not in holder_row and holder_row["calls_served"] == 9
    assert resident_row["experts"] == "its layers'" and "bytes_read" not in resident_row
    assert "own_expert_bytes" not in resident_row and resident_row["forward_s"] == 1.0
