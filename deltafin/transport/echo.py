"""Measuring a link with the `Echo` RPC: its round trip (the median of a few empty echoes) and its bandwidth each
way (a payload sent, then one asked back, doubled from SMALL until one transfer takes TRANSFER_S, at most LARGEST;
the round trip taken off). A short probe: about a second on Wi-Fi, less on wired links, so it runs whenever a cluster
forms or a worker rejoins. The coordinator measures its link to each worker; a worker measures its link to another
(`MeasureLink`) with the same code over its own channel (worker/service.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable

from deltafin.plan.cluster.links import Link

PINGS = 5  # empty echoes, their median the round trip
SMALL = 64 << 10  # the first payload
LARGEST = 8 << 20  # the most a transfer sends (beyond ~30 Gbit/s a link is no plan's bottleneck)
TRANSFER_S = 0.25  # a transfer this long is long enough to time (far beyond a round trip)
MAX_REPLY = 64 << 20  # the most an Echo answers with (a larger ask is refused)

Echo = Callable[[bytes, int], Awaitable[int]]  # (payload, reply bytes) -> the reply's size, once it arrived


async def measure(echo: Echo, address: str = "") -> Link:
    """The link behind `echo` (see the module docstring)."""
    rtts = []
    for _ in range(PINGS):
        t0 = time.perf_counter()
        await echo(b"", 0)
        rtts.append(time.perf_counter() - t0)
    rtt = statistics.median(rtts)
    up, sent = await _bandwidth(lambda n: echo(bytes(n), 0), rtt)
    down, received = await _bandwidth(lambda n: echo(b"", n), rtt)
    return Link(rtt, up, down, address, sent + received)


async def _bandwidth(send: Callable[[int], Awaitable[int]], rtt: float) -> tuple[float, int]:
    """Bytes a second through `send(n)`, from the first transfer that took TRANSFER_S (or the largest), and the
    bytes the transfers moved."""
    n, moved = SMALL, 0
    while True:
        t0 = time.perf_counter()
        await send(n)
        took = time.perf_counter() - t0
        moved += n
        if took >= TRANSFER_S or n >= LARGEST:
            return n / max(took - rtt, 1e-6), moved
        n *= 2
