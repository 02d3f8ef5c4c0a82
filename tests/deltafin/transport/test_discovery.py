"""Bonjour discovery on the loopback interface: announced workers are found, their TXT records round-trip."""

from __future__ import annotations

import asyncio
import time

from deltafin.transport.discovery import browse
from tests.support.cluster import workers


def test_discovery_finds_announced_workers_and_txt_round_trips(tiny_dir):
    with workers(tiny_dir, 2, announce=True, prefix="disc") as procs:
        found = {d.name: d for d in browse(timeout=5, interfaces=["127.0.0.1"], expect=2)}
        assert {"disc0", "disc1"} <= set(found)
        d = found["disc0"]
        assert d.address == procs[0].address
        assert d.layers == ((0, 6),) and d.has_top and d.memory_bytes == 4 * 10**9 and d.disk_gbps == 2.0
        # the TXT record says what Info says
        from deltafin.coordinator.cluster.worker_client import WorkerClient

        async def info():
            client = WorkerClient(d.address)
            try:
                return await client.info()
            finally:
                await client.close()

        i = asyncio.run(info())
        assert (i.model_fingerprint, i.layers, i.has_top, i.device) == (d.model_fingerprint, d.layers, d.has_top,
                                                                          d.device)
        # SIGTERM: graceful exit, and the announcement is withdrawn
        assert procs[1].stop() == 0
        time.sleep(0.5)
        names = {w.name for w in browse(timeout=2, interfaces=["127.0.0.1"])}
        assert "disc1" not in names and "disc0" in names


def test_a_machine_hears_its_own_announcement_on_loopback():
    from deltafin.transport.discovery import hears_itself

    assert hears_itself(["127.0.0.1"], timeout=5.0)


def test_finding_nobody_names_the_silent_causes_and_the_way_around_them():
    """macOS's Local Network privacy setting stops Bonjour for an app without an error: the message names it (and
    where it is set) on a Mac, multicast filtering elsewhere, and --worker HOST:PORT and --local on both."""
    from deltafin.transport.discovery import nobody_answered

    mac = nobody_answered(3.0, "darwin")
    assert "System Settings › Privacy & Security › Local Network" in mac and "within 3s" in mac
    linux = nobody_answered(3.0, "linux")
    assert "firewall" in linux and "Local Network" in linux
    for said in (mac, linux):
        assert "--worker HOST:PORT" in said and "--local" in said and "deltafin doctor" in said
