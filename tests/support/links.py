"""Slow links in front of workers, for tests and benches: a `../shared/tools/linkproxy` process for each worker
address (or, in a checkout with no `../shared` beside it, tests/support/linksim.py, which behaves the same),
listening on a free port of 127.0.0.1 and forwarding there with a round-trip time and a bandwidth per direction and
connection (see the tool's docstring). Callers dial `proxy.addresses` instead of the workers'; when stopped, the
proxies say the bytes each link carried each way.

A process per link, because one linkproxy serving several pairs shares its rate among the connections that move
at once (measured: two 10 MB flows through one process at 20 Mbit/s each took 7.2 and 7.7 s, 4.0 s each through
two): each simulated Mac has a link of its own.

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
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.cluster import TOOLS

LINKPROXY = TOOLS / "linkproxy" if (TOOLS / "linkproxy").is_file() else Path(__file__).with_name("linksim.py")
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
    """Running linkproxies in front of `targets` (HOST:PORT each); `addresses[i]` reaches `targets[i]`."""

    def __init__(self, targets: list[str], rtt_ms: float, mbps: float, ports: list[int] | None = None,
                 shared_mbps: float = 0.0):
        self.targets = list(targets)
        self.ports = list(ports) if ports is not None else [free_port() for _ in targets]
        self.rtt_ms, self.mbps, self.shared_mbps = rtt_ms, mbps, shared_mbps
        self.procs: list[subprocess.Popen] = []
        self.carried: dict[str, Carried] = {}
        try:
            if shared_mbps:  # one process: every link draws on its one rate
                self.procs.append(self._start(self.ports, self.targets))
            else:
                for port, target in zip(self.ports, targets, strict=True):
                    self.procs.append(self._start([port], [target]))
        except BaseException:
            self.stop()
            raise

    def _start(self, ports: list[int], targets: list[str]) -> subprocess.Popen:
        pairs = [arg for port, target in zip(ports, targets, strict=True) for arg in ("--listen", str(port), "--to",
                                                                                     target)]
        shared = ["--shared-mbps", str(self.shared_mbps)] if self.shared_mbps else []
        proc = subprocess.Popen([sys.executable, str(LINKPROXY), "--rtt-ms", str(self.rtt_ms), "--mbps",
                                 str(self.mbps), *shared, *pairs],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for port in ports:
            _wait_listening(proc, port)
        return proc

    def drop(self, i: int, seconds: float) -> threading.Thread:
        """Link `i` down for `seconds` (a Wi-Fi roam, a re-plugged cable): its proxy killed, its connections cut, and
        after that one listening on the same port again (the thread that brings it back, started). Links of their
        own only (a shared medium's are one process)."""
        if self.shared_mbps:
            raise ValueError("a link of a shared medium cannot drop alone")
        self.procs[i].kill()
        self.procs[i].wait()

        def back() -> None:
            time.sleep(seconds)
            self.procs[i] = self._start([self.ports[i]], [self.targets[i]])

        thread = threading.Thread(target=back, name=f"link-{i}-back", daemon=True)
        thread.start()
        return thread

    def __enter__(self) -> LinkProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    def stop(self, timeout: float = 10.0) -> dict[str, Carried]:
        """SIGTERM, and the bytes each link carried (by target address)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        by_port = dict(zip(self.ports, self.targets, strict=True))
        for proc in self.procs:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            for m in CARRIED.finditer(out or ""):
                self.carried[by_port[int(m.group(1))]] = Carried(int(m.group(2).replace(",", "")),
                                                                 int(m.group(3).replace(",", "")))
        return self.carried


def _wait_listening(proc: subprocess.Popen, port: int) -> None:
    """Until it has said it listens on `port`."""
    while True:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            proc.wait()
            raise RuntimeError(f"linkproxy exited with status {proc.returncode} before it listened")
        m = LISTENING.match(line)
        if m and int(m.group(1)) == port:
            return


@contextmanager
def slow_links(targets: list[str], rtt_ms: float, mbps: float, shared_mbps: float = 0.0) -> Iterator[LinkProxy]:
    """A LinkProxy in front of `targets` while the block runs (`shared_mbps`: every link on one medium of that
    rate); its `carried` is filled when the block ends."""
    proxy = LinkProxy(targets, rtt_ms, mbps, shared_mbps=shared_mbps)
    try:
        yield proxy
    finally:
        proxy.stop()
