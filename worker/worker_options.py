"""The worker daemon's own options, as one typed value: where it listens and is announced, how it is secured, how
long it keeps idle sequences, and the stage options every stage it serves is held with. `deltafin-worker`'s flags are
made from its fields (deltafin/cli/worker.py); it checks itself when built, so the daemon (worker/daemon.py) sees
only values that make sense. Light to import (no torch, no gRPC), so that `--help` is made from it at once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deltafin.errors import DeltafinError
from deltafin.options import DEVICES, check_choice, from_values, opt
from deltafin.runtime.stage_options import StageOptions, stage_options
from deltafin.transport.ports import check_address
from deltafin.transport.protocol import DEFAULT_MAX_MESSAGE

MB = 1 << 20


@dataclass(frozen=True)
class WorkerOptions:
    """A worker daemon: its model directory, how it is reached and secured, and its stages' options (`stage`)."""

    model: str
    host: str = opt("127.0.0.1", "address to listen on (default %(default)s; use 0.0.0.0 or a LAN address to serve "
                    "other machines, on a network you trust: the worker runs whatever a coordinator asks)")
    port: int = opt(0, "port (default: any free port, printed at start)")
    advertise: tuple[str, ...] = opt(
        (), "an address this worker is reached at, announced instead of the one it listens on (repeatable: a "
        "Thunderbolt bridge's and Wi-Fi's, a forwarded port's); with --host 0.0.0.0 and none given, every interface's "
        "address is announced. A coordinator measures each and uses the fastest", metavar="HOST:PORT")
    device: str = opt("auto", "the device this worker computes on (default %(default)s: mps, then cuda, then the cpu)",
                      choices=DEVICES)
    name: str | None = opt(None, "name in the announcement and plans (default: host name)")
    announce: bool = opt(True, "do not announce over Bonjour", off="--no-announce")
    interface: tuple[str, ...] | None = opt(None, "announce only on this interface address (repeatable; default: all)")
    disk_gbps: str | None = opt(None, "skip the disk measurement: the --model disk's speed in GB/s, then each "
                                "--expert-dir's", metavar="GBPS[,GBPS...]")
    grace: float = opt(10.0, "seconds in-flight calls get at shutdown (default %(default)s)")
    session_ttl: float = opt(900.0, "drop a sequence's caches after this many seconds without use (default "
                             "%(default)s)")
    max_message_mb: float = opt(DEFAULT_MAX_MESSAGE / MB, "largest gRPC message in or out (default %(default)s MB)")
    cluster_key: str | None = opt(
        None, "shared secret every coordinator call must be signed with (or $DELTAFIN_CLUSTER_KEY, or "
        "--cluster-key-file); without one, anyone who can reach the port can use the worker")
    cluster_key_file: str | None = opt(None, "read the cluster key from this file")
    tls_cert: str | None = opt(None, "serve TLS with this certificate (PEM)")
    tls_key: str | None = opt(None, "... and this private key (PEM)")
    tls_client_ca: str | None = opt(
        None, "mutual TLS: accept only coordinators (and other workers) whose certificate this CA signed")
    tls_ca: str | None = opt(
        None, "wide experts: trust other workers' certificates signed by this CA when calling them (default: "
        "--tls-client-ca, else the system's roots); a worker that serves TLS calls its peers with TLS and presents "
        "its own --tls-cert")
    tls_server_name: str | None = opt(None, "the name other workers' certificates carry, when it is not the address "
                                      "dialled")
    stage: StageOptions = field(default_factory=StageOptions)

    def __post_init__(self) -> None:
        check_choice("device", self.device, DEVICES)
        for address in self.advertise:
            check_address(address, "--advertise")
        if self.port < 0 or self.port > 65535:
            raise DeltafinError(f"--port must be 0-65535, not {self.port}")
        if self.grace < 0 or self.session_ttl <= 0 or self.max_message_mb <= 0:
            raise DeltafinError("--grace must not be negative; --session-ttl and --max-message-mb must be positive")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise DeltafinError("--tls-cert and --tls-key go together")
        if (self.tls_client_ca or self.tls_ca) and not self.tls_cert:
            raise DeltafinError("--tls-client-ca and --tls-ca need --tls-cert and --tls-key")
        self.given_disk_speeds(1 + len(self.stage.expert_dir))  # a malformed --disk-gbps is refused now

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> WorkerOptions:
        """From values named as the flags are (`host`, `advertise`, `memory_gb`, ...); the stage's among them."""
        return from_values(cls, values, stage=stage_options(values))

    @property
    def max_message(self) -> int:
        return int(self.max_message_mb * MB)

    @property
    def loopback(self) -> bool:
        return self.host in ("localhost", "::1") or self.host.startswith("127.")

    def given_disk_speeds(self, disks: int) -> tuple[float, ...] | None:
        """--disk-gbps for `disks` disks (--model's, then each --expert-dir's; one speed stands for all), or None
        where the disks are to be measured."""
        if self.disk_gbps is None:
            return None
        try:
            speeds = tuple(float(x) for x in self.disk_gbps.split(","))
        except ValueError:
            raise DeltafinError(f"--disk-gbps takes numbers separated by commas, not {self.disk_gbps!r}") from None
        if len(speeds) == 1:
            speeds = speeds * disks
        if len(speeds) != disks or min(speeds) < 0:
            raise DeltafinError(f"--disk-gbps gives {len(speeds)} speeds for {disks} disks (--model and each "
                                "--expert-dir), or a negative one")
        return speeds
