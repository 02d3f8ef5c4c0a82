"""Slow links in front of workers, for tests and benches: one `../shared/tools/linkproxy` process that listens on a
free port of 127.0.0.1 for each worker address and forwards it there with a round-trip time and a bandwidth per
direction and connection (see the tool's docstring). Callers dial `proxy.addresses` instead of the workers'; when
stopped, the proxy says the bytes each link carried each way.

    with slow_links([w.address for w in procs], rtt_ms=40, mbps=4) as proxy:
        ... ClusterSpec(model, addresses=proxy.addresses) ...
    proxy.carried  # {worker address: Carried(to=..., back=...)}
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tests.support.cluster import TOOLS

LINKPROXY = TOOLS / "linkproxy"
LISTENING = re.compile(r"linkproxy: 127\.0\.0\.1:(\d+) -> ")
CARRIED = re.compile(r"linkproxy: 127\.0\.0\.1:(\d+) carried ([\d,]+) bytes to, ([\d,]+) back")


@dataclass(frozen=True)
class Carried:
    """Bytes one link carried: `to` the worker, `back` from it."""

    to: int
    back: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LinkProxy:
    """A running linkproxy in front of `targets` (HOST:PORT each); `addresses[i]` reaches `targets[i]`."""

    def __init__(self, targets: list[str], rtt_ms: float, mbps: float, ports: list[int] | None = None):
        self.targets = list(targets)
        self.ports = list(ports) if ports is not None else [free_port() for _ in targets]
        cmd = [sys.executable, str(LINKPROXY), "--rtt-ms", str(rtt_ms), "--mbps", str(mbps)]
        for port, target in zip(self.ports, targets, strict=True):
            cmd += ["--listen", str(port), "--to", target]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.carried: dict[str, Carried] = {}
        self._wait_listening()

    def __enter__(self) -> LinkProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    def _wait_listening(self) -> None:
        """Until it has said it listens on every port (one line each)."""
        heard: set[int] = set()
        while heard != set(self.ports):
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                self.proc.wait()
                raise RuntimeError(f"linkproxy exited with status {self.proc.returncode} before it listened")
            m = LISTENING.match(line)
            if m:
                heard.add(int(m.group(1)))

    def stop(self, timeout: float = 10.0) -> dict[str, Carried]:
        """SIGTERM, and the bytes each link carried (by target address)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        by_port = dict(zip(self.ports, self.targets, strict=True))
        for m in CARRIED.finditer(out or ""):
            self.carried[by_port[int(m.group(1))]] = Carried(int(m.group(2).replace(",", "")),
                                                             int(m.group(3).replace(",", "")))
        return self.carried


@contextmanager
def slow_links(targets: list[str], rtt_ms: float, mbps: float) -> Iterator[LinkProxy]:
    """A LinkProxy in front of `targets` while the block runs; its `carried` is filled when the block ends."""
    proxy = LinkProxy(targets, rtt_ms, mbps)
    try:
        yield proxy
    finally:
        proxy.stop()
