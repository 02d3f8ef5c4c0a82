"""A link's probe: its round trip and its bandwidth each way, from echoes timed against a link of known speed."""

from __future__ import annotations

import asyncio

import pytest

from deltafin.transport.echo import measure


@pytest.mark.parametrize("rtt, up, down", [(0.004, 2e6, 1e6), (0.0005, 50e6, 50e6)])
def test_the_probe_finds_a_links_round_trip_and_its_bandwidth_each_way(rtt, up, down):
    """An echo that takes rtt plus each way's bytes at that way's rate (as linkproxy's links do)."""
    async def echo(payload: bytes, reply_bytes: int) -> int:
        await asyncio.sleep(rtt + len(payload) / up + reply_bytes / down)
        return reply_bytes

    link = asyncio.run(measure(echo, "h:1"))
    assert link.address == "h:1" and link.rtt_s == pytest.approx(rtt, rel=0.5, abs=2e-3)
    assert link.up_bps == pytest.approx(up, rel=0.2) and link.down_bps == pytest.approx(down, rel=0.2)
