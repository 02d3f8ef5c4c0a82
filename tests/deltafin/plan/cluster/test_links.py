"""The links as the plan reads them: each direction, the coordinator's and the workers', the assumed kind where
nothing was measured, and what moving bytes over one takes."""

from __future__ import annotations

import math

import pytest

from deltafin.plan.cluster.links import ASSUMED, COORDINATOR, PROFILES, Link, Links, profile


def test_a_link_is_read_from_either_end_and_unmeasured_ones_are_assumed():
    a_to_b = Link(0.004, 1e6, 2e6, "b:1")
    links = Links({"a": Link(0.001, 5e6, 6e6, "a:1")}, {("a", "b"): a_to_b}, names={"a": "mac1", "b": "mac2"})
    assert links.between("a", "b") == a_to_b
    assert (links.between("b", "a").up_bps, links.between("b", "a").down_bps) == (2e6, 1e6)
    assert links.between(COORDINATOR, "a").up_bps == 5e6 and links.between("a", COORDINATOR).up_bps == 6e6
    assert links.between(COORDINATOR, "b") == ASSUMED and links.between("b", "c") == ASSUMED
    assert links.between("a", "a").seconds(1e9, 1e9) == 0 and math.isinf(links.between("a", "a").up_bps)
    assert links.describe() == ["  coordinator -> mac1: 1.00 ms, 40 Mbit/s up / 48 Mbit/s down (a:1)",
                                "  mac1 -> mac2: 4.00 ms, 8 Mbit/s up / 16 Mbit/s down (b:1)"]


def test_moving_bytes_takes_round_trips_and_each_way_at_its_rate():
    wifi = PROFILES["wifi"]
    assert wifi == profile(4.0, 400) and wifi.up_bps == 50e6
    assert wifi.seconds(50e6, 25e6) == pytest.approx(0.004 + 1.0 + 0.5)
    assert wifi.seconds(0, 0, round_trips=92) == pytest.approx(0.368)


def test_links_on_one_medium_share_its_rate():
    """Two transfers at once: on links of their own, the slower one's time; on one medium of the same rate (a Wi-Fi
    channel), their bytes together over it; a link while n flows move gets 1/n of the medium."""
    wifi = PROFILES["wifi"]  # 50 MB/s each way
    own, air = Links(assumed=wifi), Links(assumed=wifi, shared_bps=wifi.up_bps)
    moves = [(wifi, 50e6, 0.0), (wifi, 0.0, 50e6)]  # a relayed hop: into the coordinator and out at once
    assert own.together(moves, 0) == pytest.approx(1.0)
    assert air.together(moves, 0) == pytest.approx(2.0)
    assert air.together(moves[:1], 0) == own.together(moves[:1], 0)  # alone, the medium is its own
    assert air.together([(wifi, 1.0, 1.0)] * 3) == pytest.approx(0.004 + 6 / 50e6)  # the round trip, once
    assert air.sharing(wifi, 4).up_bps == pytest.approx(12.5e6) and own.sharing(wifi, 4) == wifi
    assert air.describe()[-1] == "  one medium: every link shares 400 Mbit/s (measured two at once)"
