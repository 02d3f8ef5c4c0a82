"""The cluster's links, measured as it forms (deltafin/plan/cluster/links.py prices them): the coordinator's to each
worker, and each pair of workers' (measured by one of the two, `MeasureLink`: the stage hops handed over directly,
plan/timing/hops.py, and the wide experts' calls). One link at a
time, so that no probe shares a link with another; a link measured before is kept (a re-plan after a loss measures
only the workers it has not seen: a worker that rejoins is a new process, with a new id, and is measured again). A
link that cannot be measured is priced as the assumed kind, with a warning. Then two of the coordinator's links are
measured at once: where together they carry about what one carried alone, they are one medium (one Wi-Fi channel),
and every link is priced as sharing its rate (plan/cluster/links.py `Links.shared_bps`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from deltafin.errors import RemoteError
from deltafin.plan.cluster.links import Link, Links

log = logging.getLogger(__name__)

MOVED = 1 << 20  # what an address is timed by: a round trip and a MiB each way (a layer's rows, a stage's hop)
SHARED_BELOW = 1.4  # two links measured at once that carry under this many times the faster one alone share a medium


class LinkProbe:
    """Measures and remembers links, keyed by the workers' ids and addresses."""

    def __init__(self) -> None:
        self.to_workers: dict[tuple[str, str], Link] = {}
        self.pairs: dict[tuple[str, str, str], Link] = {}
        self.media: dict[tuple[tuple[str, str], tuple[str, str]], float] = {}  # two links' shared rate (0: none)

    async def links(self, workers: Sequence[tuple[Any, Any]], pairs: bool) -> Links:
        """The links of `workers` ((client, description) each); with `pairs`, between them too."""
        to = {}
        for client, d in workers:
            link = await self._measure(self.to_workers, (d.key, d.address), client.measure_link, d.name)
            if link is not None:
                to[d.key] = link
        between = {}
        for i, (client, a) in enumerate(workers if pairs else ()):
            for _, b in workers[i + 1:]:  # b at the address the coordinator chose (fastest)
                measure = lambda c=client, at=b.address: c.measure_link_to(at)
                link = await self._measure(self.pairs, (a.key, b.key, b.address), measure, f"{a.name} -> {b.name}")
                if link is not None:
                    between[a.key, b.key] = link
        measured = [(c, d) for c, d in workers if d.key in to]
        shared = await self._medium(measured[:2]) if len(measured) >= 2 else 0.0
        return Links(to, between, names={d.key: d.name for _, d in workers}, shared_bps=shared)

    async def _medium(self, two: Sequence[tuple[Any, Any]]) -> float:
        """The rate two of the coordinator's links share, measured by moving on both at once (0: each its own)."""
        (c1, d1), (c2, d2) = two
        key = ((d1.key, d1.address), (d2.key, d2.address))
        if key not in self.media:
            alone = [self.to_workers[k] for k in key]
            try:
                both = await asyncio.gather(c1.measure_link(), c2.measure_link())
            except RemoteError as e:
                log.warning("two links could not be measured at once (%s): priced as each its own", e)
                return 0.0
            rate = both[0].up_bps + both[1].up_bps
            shared = rate < SHARED_BELOW * max(a.up_bps for a in alone)
            self.media[key] = rate if shared else 0.0
            log.info("links to %s and %s at once: %s", d1.name, d2.name,
                     f"one medium of {rate * 8 / 1e6:.0f} Mbit/s" if shared else "each its own")
        return self.media[key]

    async def fastest(self, workers: Sequence[tuple[Any, Any]], connect: Callable[[str], Any]
                      ) -> list[tuple[Any, Any]]:
        """Each worker (client, description) reached at the fastest of the addresses it announces, as measured from
        here (a Thunderbolt bridge's over Wi-Fi's); `connect(address)` makes a client. A worker that announces one
        address keeps it."""
        out = []
        for client, d in workers:
            choices = [(client, d.address)] + [(None, a) for a in d.addresses if a != d.address]
            if len(choices) == 1:
                out.append((client, d))
                continue
            timed = []
            for c, address in choices:
                c = c or connect(address)
                link = await self._measure(self.to_workers, (d.key, address), c.measure_link, f"{d.name} at {address}")
                timed.append((link.seconds(MOVED, MOVED) if link is not None else math.inf, address, c))
            _, address, best = min(timed, key=lambda t: t[0])
            for _, _, c in timed:
                if c is not best:
                    await c.close()
            if address != d.address:
                log.info("%s: using %s, its fastest address (%s)", d.name, address,
                         ", ".join(f"{a} {s * 1e3:.1f} ms" for s, a, _ in timed))
            out.append((best, dataclasses.replace(d, address=address)))
        return out

    @staticmethod
    async def _measure(cache: dict, key: tuple, run: Any, what: str) -> Link | None:
        if key not in cache:
            try:
                cache[key] = await run()
            except RemoteError as e:
                log.warning("the link to %s could not be measured (%s): priced as assumed", what, e)
                return None
            log.info("link to %s: %s", what, cache[key].describe())
        return cache[key]
