"""Where the model runs, as one typed value: the workers found or named, or this process (single-machine mode), and
how the coordinator reaches them. The command line's cluster flags are made from its fields (deltafin/cli/flags.py),
the Python API builds it from keywords; connect.py opens what it says. Light to import (no torch, no gRPC), so that
`--help` is made from it at once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deltafin.errors import DeltafinError
from deltafin.options import DEVICES, EXPERT_PLACEMENTS, HOP_MODES, check_choice, from_values, opt
from deltafin.transport.ports import check_address

if TYPE_CHECKING:
    from deltafin.transport.auth import ClientTls


@dataclass(frozen=True)
class ClusterOptions:
    """Where the stages run (workers found or named, or this process) and how the coordinator reaches them."""

    model: str
    worker: tuple[str, ...] = opt(
        (), "a worker to use (repeatable; port 1-65535, an IPv6 host in brackets: [::1]:7070); discovered workers "
        "are added unless --no-discover", metavar="HOST:PORT")
    discover: bool = opt(True, "use only the --worker addresses", off="--no-discover")
    discover_timeout: float = opt(3.0, "seconds to browse for workers (default %(default)s)")
    expect: int | None = opt(None, "stop browsing once this many workers answered")
    interface: tuple[str, ...] | None = opt(None, "browse only on this interface address (repeatable)")
    local: bool = opt(False, "single-machine mode: run the stages in this process")
    local_stages: int = opt(1, "--local: in-process stages (default %(default)s)")
    device: str = opt("auto", "the device this process computes on (default %(default)s: mps, then cuda, then the cpu)",
                      choices=DEVICES)
    experts: str = opt(
        "auto", "wide: every worker reads and computes its share of every layer's routed experts, so every disk works "
        "on every token; local: each stage reads its own layers' experts; auto (default): the faster for a chat "
        "turn, priced with the links, disks and compute measured (the plan says why)", choices=EXPERT_PLACEMENTS)
    hops: str = opt(
        "auto", "how a stage's states reach the next stage: relay: through the coordinator; direct: from worker to "
        "worker where the link between them was measured (a hand-off that fails is relayed); auto (default): the "
        "faster for each forward, priced with the links measured (on one Wi-Fi, a prompt's go directly: relayed they "
        "cross the air twice)", choices=HOP_MODES)
    cluster_key: str | None = opt(
        None, "the workers' shared secret (or $DELTAFIN_CLUSTER_KEY, or --cluster-key-file)")
    cluster_key_file: str | None = opt(None, "read the cluster key from this file")
    tls_ca: str | None = opt(None, "connect with TLS, trusting workers' certificates signed by this CA (PEM)")
    tls_cert: str | None = opt(None, "mutual TLS: this coordinator's certificate (PEM)")
    tls_key: str | None = opt(None, "mutual TLS: its private key (PEM)")
    tls_server_name: str | None = opt(
        None, "the name the workers' certificates carry, when it is not the address dialled")
    worker_timeout: float = opt(
        10.0, "a worker that shows no sign of life for this many seconds during a forward is lost: no answer to the "
        "liveness probes (on a connection of their own) and no part of the forward's states sent or received, so a "
        "slow link that still moves them is not a dead worker (default %(default)s)")
    forward_timeout: float = opt(
        600.0, "deadline of one stage's forward of up to 512 tokens, longer ones in proportion (default %(default)s: "
        "one prompt chunk may stream every expert of the stage)")
    reconnect_timeout: float = opt(
        15.0, "a worker of the plan that stops answering (a link that dropped: a Wi-Fi roam, a re-plugged cable, a "
        "restarted switch) is asked again for this many seconds before the cluster is planned without it; if it comes "
        "back with its sessions, the step that failed is retried there (default %(default)s; 0: plan without it at "
        "once)")
    recovery: bool = opt(True, "fail requests when a worker is lost instead of re-planning and replaying",
                         off="--no-recovery")
    replay_journal_tokens: int = opt(
        1 << 22, "tokens of live sequences kept for replay after a worker loss, 4 bytes each (default %(default)s = "
        "16 MB); sequences beyond it fail instead of recovering")
    rejoin_interval: float = opt(
        5.0, "seconds between looks for returning or new workers while idle (0: never; default %(default)s)")

    def __post_init__(self) -> None:
        check_choice("device", self.device, DEVICES)
        check_choice("experts", self.experts, EXPERT_PLACEMENTS)
        check_choice("hops", self.hops, HOP_MODES)
        if self.worker_timeout <= 0 or self.forward_timeout <= 0:
            raise DeltafinError("--worker-timeout and --forward-timeout must be positive")
        if self.reconnect_timeout < 0:
            raise DeltafinError("--reconnect-timeout must not be negative")
        for address in self.worker:
            check_address(address)

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> ClusterOptions:
        """From values named as the flags are (`worker`, `local`, `worker_timeout`, ...)."""
        return from_values(cls, values)

    @property
    def tls(self) -> ClientTls | None:
        if not (self.tls_ca or self.tls_cert or self.tls_key or self.tls_server_name):
            return None
        from deltafin.transport.auth import ClientTls  # here: it loads gRPC, which the options themselves do not

        tls = ClientTls(self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)
        tls.credentials()  # unreadable files fail here, with their names
        return tls
