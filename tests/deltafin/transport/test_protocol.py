"""The protocol's version and its history beside the proto agree, and a peer of another version is refused with a line
that names the side to upgrade: the older one (what the coordinator's probe logs, with a worker one version apart
either way)."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

from deltafin.checkpoint.shards import fingerprint
from deltafin.coordinator.cluster import workers as cluster_workers
from deltafin.coordinator.cluster.workers import ClusterSpec, probe_workers
from deltafin.transport.protocol import PROTOCOL_VERSION, version_gap
from deltafin.transport.worker_info import WorkerDescription

HISTORY = Path(__file__).resolve().parents[3] / "proto" / "HISTORY.md"


def test_the_history_beside_the_proto_ends_at_the_version_spoken() -> None:
    versions = [int(m) for m in re.findall(r"^\| (\d+) \|", HISTORY.read_text(), re.M)]
    assert versions == list(range(1, PROTOCOL_VERSION + 1))


def test_the_older_side_is_the_one_to_upgrade() -> None:
    assert "upgrade mac2 " in version_gap("mac2", PROTOCOL_VERSION - 1)
    assert "upgrade this coordinator " in version_gap("mac2", PROTOCOL_VERSION + 1)
    assert f"protocol {PROTOCOL_VERSION - 1}, this coordinator {PROTOCOL_VERSION}" in version_gap(
        "mac2", PROTOCOL_VERSION - 1)


def test_the_probe_leaves_out_a_worker_one_version_apart_saying_which_to_upgrade(tiny_dir, monkeypatch,
                                                                                  caplog) -> None:
    answers = {"h:1": PROTOCOL_VERSION - 1, "h:2": PROTOCOL_VERSION + 1, "h:3": PROTOCOL_VERSION}

    class Client:
        def __init__(self, address: str, **_: object) -> None:
            self.address = address

        async def info(self, timeout: float | None = None) -> WorkerDescription:
            return WorkerDescription(f"w{self.address[-1]}", self.address, "cpu", 1 << 30, 1.0, fingerprint(tiny_dir),
                                     ((0, 8),), True, protocol_version=answers[self.address])

        async def close(self) -> None:
            pass

    monkeypatch.setattr(cluster_workers, "WorkerClient", Client)
    with caplog.at_level(logging.WARNING):
        kept = asyncio.run(probe_workers(ClusterSpec(tiny_dir, discover=False), list(answers)))
    assert [info.name for _, info in kept] == ["w3"]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "leaving out w1: w1 speaks protocol" in said and "upgrade w1 " in said
    assert "leaving out w2: w2 speaks protocol" in said and "upgrade this coordinator " in said
