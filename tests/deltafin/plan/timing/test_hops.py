"""A forward's stage hops: relayed by the coordinator, or handed directly where the link between the two workers
was measured and that is faster; what each way takes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deltafin.checkpoint.config import parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.plan.cluster.cluster_plan import WorkerCapacity
from deltafin.plan.cluster.links import COORDINATOR, PROFILES, Link, Links, profile
from deltafin.plan.planner import plan_layers
from deltafin.plan.timing.hops import describe_hops, direct_hops, hop_bytes, hop_ways, hops_seconds
from deltafin.plan.timing.predict import plan_summary

K3 = parse_config(preset_config("k3"))


def _two_macs(links: Links):
    macs = [WorkerCapacity(f"m{i}", 56 * 10**9, 6.6, ((0, 93),), True, address=f"m{i}:1", device="mps",
                           worker_id=f"m{i}") for i in range(2)]
    return plan_layers(K3, macs, experts="local", links=links)


def test_a_relayed_hop_crosses_a_shared_medium_twice():
    """Two stages over Wi-Fi, no link between the workers measured: a prompt's states go from stage 0 to the
    coordinator and on to stage 1 at once (the relay); on one channel the two crossings share its airtime, so the
    hop takes twice as long."""
    wifi = PROFILES["wifi"]
    plan = _two_macs(Links(assumed=wifi))
    air = _two_macs(Links(assumed=wifi, shared_bps=wifi.up_bps))
    assert direct_hops(K3, air, 4096, 4) == (False,)  # nothing measured between the workers: relayed
    s0 = plan.stages[0]
    state = hop_bytes(K3, s0.start, s0.end, 4096, 4)[1]
    extra = hops_seconds(K3, air, 4096, 4) - hops_seconds(K3, plan, 4096, 4)
    assert extra == pytest.approx(state / wifi.up_bps, rel=1e-6)  # one more crossing of the states


def test_a_measured_link_between_the_stages_takes_a_prompt_directly_on_one_medium():
    """On one Wi-Fi channel with the workers' link measured, a prompt's states cross the air once (direct: its
    bytes over the link, a round trip for the acknowledgement and one to the coordinator), half the relayed time;
    a token's few KB stay relayed where the round trips cost more than the bytes."""
    wifi = PROFILES["wifi"]
    base = _two_macs(Links(assumed=wifi, shared_bps=wifi.up_bps))
    a, b = (s.key for s in base.stages)
    links = Links({a: wifi, b: wifi}, {(a, b): wifi}, shared_bps=wifi.up_bps)
    plan = replace(base, links=links)
    state = hop_bytes(K3, base.stages[0].start, base.stages[0].end, 4096, 4)[1]
    assert direct_hops(K3, plan, 4096, 4) == (True,)
    relayed = 2 * state / wifi.up_bps
    direct = state / wifi.up_bps + 2 * wifi.rtt_s
    saved = hops_seconds(K3, base, 4096, 4) - hops_seconds(K3, plan, 4096, 4)
    assert saved == pytest.approx(relayed - direct, rel=1e-6)
    assert direct_hops(K3, plan, 1, 4) == (False,)  # one token: 143 KB in 5.7 ms relayed, 10.9 ms direct


def test_independent_fast_links_keep_the_relay_unless_the_pair_is_faster():
    """Thunderbolt everywhere, each link its own: relaying costs the slower of the two links, no more than the
    direct link's crossing, so the hop stays relayed; a pair link faster than the coordinator's (a Thunderbolt
    bridge between two Macs, the coordinator on Wi-Fi) takes it directly."""
    tb, wifi = PROFILES["thunderbolt"], PROFILES["wifi"]
    base = _two_macs(Links(assumed=tb))
    a, b = (s.key for s in base.stages)
    same = replace(base, links=Links({a: tb, b: tb}, {(a, b): tb}))
    assert direct_hops(K3, same, 4096, 4) == (False,)
    assert hops_seconds(K3, same, 4096, 4) == pytest.approx(hops_seconds(K3, base, 4096, 4), rel=1e-12)
    bridged = replace(base, links=Links({a: wifi, b: wifi}, {(a, b): tb}))
    assert direct_hops(K3, bridged, 4096, 4) == (True,)
    slow = replace(base, links=Links({a: tb, b: tb}, {(a, b): profile(5.0, 100)}))
    assert direct_hops(K3, slow, 4096, 4) == (False,)  # a pair slower than the hub: relayed


def test_the_way_of_a_hop_reads_the_pair_from_either_end():
    """A link measured from the receiving end still counts (its directions swapped)."""
    wifi = PROFILES["wifi"]
    base = _two_macs(Links(assumed=wifi, shared_bps=wifi.up_bps))
    a, b = (s.key for s in base.stages)
    one_way = Link(0.004, 1e9, 1e6)  # fast from b to a, slow from a to b: measured at b
    links = Links({a: wifi, b: wifi}, {(b, a): one_way}, shared_bps=wifi.up_bps)
    assert links.between(a, b).up_bps == 1e6
    assert direct_hops(K3, replace(base, links=links), 4096, 4) == (False,)
    assert COORDINATOR not in (a, b)


def test_plan_says_each_hop_s_way_for_a_token_and_a_prompt():
    wifi = PROFILES["wifi"]
    base = _two_macs(Links(assumed=wifi, shared_bps=wifi.up_bps))
    a, b = (s.key for s in base.stages)
    plan = replace(base, links=Links({a: wifi, b: wifi}, {(a, b): wifi}, shared_bps=wifi.up_bps))
    longest = min(s.plan.longest_forward for s in plan.stages)
    assert hop_ways(K3, plan, 4) == [{"from": "m0", "to": "m1", "token": "relayed", "prompt": "direct",
                                      "prompt_tokens": str(longest)}]
    assert describe_hops(K3, plan, 4) == [f"stage hop m0 -> m1: a token relayed by the coordinator, a prompt's "
                                          f"forward ({longest:,} tokens) handed over directly"]
    assert plan_summary(K3, plan, [], 4)["hops"] == hop_ways(K3, plan, 4)


def test_hops_relay_or_direct_decide_instead_of_the_prices():
    """--hops relay: every hop through the coordinator, whatever the links; --hops direct: every hop whose link was
    measured worker to worker, a token's too (an unmeasured pair still goes relayed); priced the way they go."""
    wifi = PROFILES["wifi"]
    base = _two_macs(Links(assumed=wifi, shared_bps=wifi.up_bps))
    a, b = (s.key for s in base.stages)
    measured = Links({a: wifi, b: wifi}, {(a, b): wifi}, shared_bps=wifi.up_bps)
    relay, direct = (replace(base, links=replace(measured, hops=m)) for m in ("relay", "direct"))
    assert direct_hops(K3, relay, 4096, 4) == (False,) and direct_hops(K3, direct, 1, 4) == (True,)
    assert hops_seconds(K3, relay, 4096, 4) == pytest.approx(hops_seconds(K3, base, 4096, 4), rel=1e-12)
    auto = replace(base, links=measured)
    assert hops_seconds(K3, direct, 1, 4) > hops_seconds(K3, auto, 1, 4)  # a token pays the round trips
    unmeasured = replace(base, links=Links({a: wifi, b: wifi}, shared_bps=wifi.up_bps, hops="direct"))
    assert direct_hops(K3, unmeasured, 4096, 4) == (False,)
