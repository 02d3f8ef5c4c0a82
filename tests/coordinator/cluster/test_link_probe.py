"""The cluster's links, measured as it forms: the coordinator's to each worker and between workers (plan prints
them), and a worker announcing several addresses is reached at the fastest (a Thunderbolt bridge over Wi-Fi)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from types import SimpleNamespace

import pytest

from deltafin.coordinator.cluster.link_probe import LinkProbe
from deltafin.plan.cluster.links import Link
from tests.support.cluster import COORDINATOR, WorkerProcess, workers
from tests.support.links import LinkProxy, free_port, slow_links


def _plan(model, *addresses: str) -> dict:
    r = subprocess.run([*COORDINATOR, "--model", str(model), "--no-discover",
                        *(a for x in addresses for a in ("--worker", x)), "-q", "plan", "--json"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_plan_measures_the_links_and_says_them(tiny_dir):
    """Two workers, one behind a 30 ms link: plan --json has every link measured (the slow one's round trip about
    30 ms, the other's well under), the experts' mode and why, and the predictions split into disks and links."""
    with workers(tiny_dir, 2) as procs, slow_links([procs[1].address], rtt_ms=30, mbps=0) as proxy:
        plan = _plan(tiny_dir, procs[0].address, proxy.addresses[0])
    links = plan["links"]
    assert links["measured"] and set(links["coordinator"]) == {"w0", "w1"}
    assert 25 < links["coordinator"]["w1"]["rtt_ms"] < 60 and links["coordinator"]["w0"]["rtt_ms"] < 10
    assert len(links["between"]) == 1 and plan["experts"] in ("wide", "local") and plan["why"]
    assert plan["token"]["link_s"] > 0.03 and {"disk_s", "total_s"} <= set(plan["first_token"]["4096"])


def test_a_worker_is_reached_at_its_fastest_address(tiny_dir):
    """A worker reached over two links, one 40 ms and 5 Mbit/s (Wi-Fi) and one fast (a Thunderbolt bridge), that
    announces both (--advertise): found at the slow one, the cluster measures both and plans with the fast one."""
    port, slow, fast = free_port(), free_port(), free_port()
    worker = WorkerProcess(tiny_dir, "w0", "--port", str(port), "--advertise", f"127.0.0.1:{slow}",
                           "--advertise", f"127.0.0.1:{fast}")
    try:
        own = worker.wait_ready()
        with LinkProxy([own], 40, 5, ports=[slow]) as wifi, LinkProxy([own], 0.2, 0, ports=[fast]) as bridge:
            plan = _plan(tiny_dir, wifi.addresses[0])
            assert plan["workers"][0]["address"] == bridge.addresses[0]
            assert plan["links"]["coordinator"]["w0"]["address"] == bridge.addresses[0]
    finally:
        worker.stop()


class Air:
    """Links measured by scripted clients: each one alone moves `rate` bytes a second; on one medium, two measured at
    once share it (each gets half), else each keeps its own."""

    def __init__(self, shared: bool, rate: float = 50e6):
        self.shared, self.rate, self.moving = shared, rate, 0

    def client(self, address: str) -> SimpleNamespace:
        async def measure_link() -> Link:
            self.moving += 1
            await asyncio.sleep(0.05)  # both start before either ends
            rate = self.rate / self.moving if self.shared else self.rate
            await asyncio.sleep(0.05)
            self.moving -= 1
            return Link(0.004, rate, rate, address)
        return SimpleNamespace(measure_link=measure_link)


@pytest.mark.parametrize("shared", [True, False])
async def test_two_links_measured_at_once_say_whether_they_share_a_medium(shared: bool) -> None:
    air = Air(shared)
    workers = [(air.client(f"w{i}:1"), SimpleNamespace(key=f"k{i}", address=f"w{i}:1", name=f"w{i}"))
               for i in range(3)]
    links = await LinkProbe().links(workers, pairs=False)
    assert set(links.to_workers) == {"k0", "k1", "k2"}
    assert links.shared_bps == (pytest.approx(50e6) if shared else 0.0)  # their two halves: the medium's rate


def test_plan_finds_links_that_share_one_medium(tiny_dir):
    """Two workers behind links of 40 Mbit/s each: through one proxy whose pairs share 40 Mbit/s (one Wi-Fi channel),
    plan --json says one medium of about that rate; through proxies of their own, none."""
    with workers(tiny_dir, 2) as procs:
        targets = [p.address for p in procs]
        with slow_links(targets, rtt_ms=2, mbps=40, shared_mbps=40) as air:
            shared = _plan(tiny_dir, *air.addresses)
        with slow_links(targets, rtt_ms=2, mbps=40) as own:
            separate = _plan(tiny_dir, *own.addresses)
    assert 25 < shared["links"]["shared_mbit_s"] < 60, shared["links"]
    assert separate["links"]["shared_mbit_s"] is None, separate["links"]
