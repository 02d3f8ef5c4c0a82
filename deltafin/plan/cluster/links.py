"""The links between a cluster's machines as the plan reads them (pure): each one's round trip and bandwidth, as
measured when the cluster forms (transport/echo.py: a short probe, again when a worker rejoins), or a named
profile where nothing was measured. The planner prices with them what crosses them: the stage hops (a prompt's or
a token's hidden states from stage to stage, relayed or handed over: plan/timing/hops.py) and, with wide experts, each
MoE layer's expert calls between a stage and the other holders (one round trip, a row a token each way). Links on one
medium
(one Wi-Fi channel: every station shares its airtime, and a hop relayed through the coordinator crosses it twice)
are found by measuring two at once (coordinator/cluster/link_probe.py); what crosses them at once is then priced as
its bytes together over the medium's rate (`together`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

COORDINATOR = ""  # the coordinator's key in a link table (workers' keys are their ids)


@dataclass(frozen=True)
class Link:
    """One link: its round trip in seconds and its bandwidth each way in bytes per second (from the near end)."""

    rtt_s: float
    up_bps: float
    down_bps: float
    address: str = ""  # the far end's address it was measured on (a worker may announce several)
    probe_bytes: int = 0  # what measuring it moved, both ways (a bench counting a link's bytes takes it off)

    def seconds(self, up: float, down: float, round_trips: float = 1.0) -> float:
        """What moving `up` bytes out and `down` back takes, with `round_trips` waits for an answer."""
        return round_trips * self.rtt_s + up / max(self.up_bps, 1.0) + down / max(self.down_bps, 1.0)

    def reversed(self) -> Link:
        """The same link seen from its far end."""
        return Link(self.rtt_s, self.down_bps, self.up_bps, self.address)

    def describe(self) -> str:
        return f"{self.rtt_s * 1e3:.2f} ms, {_rate(self.up_bps)} up / {_rate(self.down_bps)} down"


def profile(rtt_ms: float, mbit_s: float) -> Link:
    """A link kind by its round trip (ms) and its bandwidth (Mbit/s, each way)."""
    return Link(rtt_ms / 1e3, mbit_s * 1e6 / 8, mbit_s * 1e6 / 8)


# link kinds between two Macs (README, the cluster's projections; tests/system/link_bench.py runs them)
PROFILES: Mapping[str, Link] = {
    "thunderbolt": profile(0.5, 10_000),  # a Thunderbolt bridge (IP over Thunderbolt, TCP)
    "10gbe": profile(0.2, 10_000),
    "1gbe": profile(0.3, 1_000),
    "wifi": profile(4.0, 400),  # Wi-Fi 6 between two Macs in one room
}
ASSUMED = PROFILES["thunderbolt"]  # where a link was not measured (the plan says so)


@dataclass(frozen=True)
class Links:
    """The measured links: the coordinator's to each worker (`to_workers`, by key) and between workers (`pairs`,
    by the two keys sorted); anything unmeasured is `assumed`. `value_bytes`: what a state's or a row's value takes
    crossing them (4: the exact fp32 wire; 2: `--wire bf16`)."""

    to_workers: Mapping[str, Link] = field(default_factory=dict)
    pairs: Mapping[tuple[str, str], Link] = field(default_factory=dict)
    assumed: Link = ASSUMED
    names: Mapping[str, str] = field(default_factory=dict)  # the workers' names, by key (for the table)
    value_bytes: int = 4
    shared_bps: float = 0.0  # every link is on one medium of this rate, bytes a second (0: each link its own)
    hops: str = "auto"  # how stage hops go (--hops, plan/timing/hops.py): the faster way, always relayed, or direct

    def together(self, moves: list[tuple[Link, float, float]], round_trips: float = 1.0) -> float:
        """What moving (link, bytes up, bytes down) of each at once takes: the slowest of them on links of their own;
        on one medium, at least their bytes together over its rate."""
        alone = max((link.seconds(up, down, round_trips) for link, up, down in moves), default=0.0)
        if not self.shared_bps or len(moves) < 2:
            return alone
        rtt = max(link.rtt_s for link, _, _ in moves) * round_trips
        return max(alone, rtt + sum(up + down for _, up, down in moves) / self.shared_bps)

    def sharing(self, link: Link, flows: int) -> Link:
        """`link` while `flows` links of the medium move at once (their share of its rate; unchanged where each link
        is its own)."""
        if not self.shared_bps or flows < 2:
            return link
        rate = self.shared_bps / flows
        return Link(link.rtt_s, min(link.up_bps, rate), min(link.down_bps, rate), link.address)

    def between(self, a: str, b: str) -> Link:
        """The link from `a` to `b` (COORDINATOR for the coordinator); a machine to itself is free."""
        if a == b:
            return Link(0.0, math.inf, math.inf)
        if COORDINATOR in (a, b):
            link = self.to_workers.get(b if a == COORDINATOR else a)
            return self.assumed if link is None else (link if a == COORDINATOR else link.reversed())
        link = self.pairs.get((a, b)) or self.pairs.get((b, a))
        if link is None:
            return self.assumed
        return link if (a, b) in self.pairs else link.reversed()

    @property
    def measured(self) -> bool:
        return bool(self.to_workers or self.pairs)

    def describe(self) -> list[str]:
        """The table's lines: each link measured, by the workers' names."""
        name = lambda key: "coordinator" if key == COORDINATOR else self.names.get(key, key)
        lines = [f"  coordinator -> {name(k)}: {v.describe()}" + (f" ({v.address})" if v.address else "")
                 for k, v in sorted(self.to_workers.items(), key=lambda kv: name(kv[0]))]
        lines += [f"  {name(a)} -> {name(b)}: {v.describe()}" + (f" ({v.address})" if v.address else "")
                  for (a, b), v in sorted(self.pairs.items(), key=lambda kv: (name(kv[0][0]), name(kv[0][1])))]
        if self.shared_bps:
            lines.append(f"  one medium: every link shares {_rate(self.shared_bps)} (measured two at once)")
        return lines


def _rate(bps: float) -> str:
    bits = bps * 8
    return f"{bits / 1e9:.1f} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.0f} Mbit/s"
