"""The stand-in link simulator (tests/support/linksim.py), run as a process in front of a local echo-less sink and
source: what it forwards arrives whole and in order, no sooner than half a round trip and the bytes at its rate
allow, and it says the bytes it carried each way. Timings are measured by the wall clock here, not by the tool."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.links import CARRIED, LISTENING, free_port

LINKSIM = Path(__file__).resolve().parents[1] / "support" / "linksim.py"
RTT_MS, MBPS = 40.0, 8.0  # 1 MB/s each way
SIZE = 600_000  # ~0.6 s at 1 MB/s, against a 64 KiB burst


def _server(reply: bytes) -> tuple[socket.socket, list[bytes]]:
    """A server that reads everything a client sends, then answers `reply` and closes."""
    srv = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            chunks = []
            while data := conn.recv(65536):
                chunks.append(data)
            got.append(b"".join(chunks))
            conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return srv, got


def test_bytes_arrive_whole_late_and_paced_and_are_counted() -> None:
    payload = bytes(range(256)) * (SIZE // 256)
    reply = b"ok" * 1000
    srv, got = _server(reply)
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(LINKSIM), "--rtt-ms", str(RTT_MS), "--mbps", str(MBPS),
                             "--listen", str(port), "--to", f"127.0.0.1:{srv.getsockname()[1]}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert LISTENING.match(proc.stdout.readline())  # type: ignore[union-attr]
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(payload)
            c.shutdown(socket.SHUT_WR)
            back = b""
            while data := c.recv(65536):
                back += data
        seconds = time.monotonic() - start
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
        srv.close()
    assert got == [payload] and back == reply
    # the payload at 1 MB/s less one burst, then the reply's half round trip back: a lower bound (pacing + delay)
    assert seconds >= (len(payload) - 65536) / (MBPS * 1e6 / 8) + RTT_MS / 2e3, seconds
    assert seconds < 10  # and it does finish (a generous bound: two shared cores)
    (m,) = CARRIED.finditer(out)
    assert (int(m.group(1)), int(m.group(2).replace(",", "")), int(m.group(3).replace(",", ""))) == \
        (port, len(payload), len(reply))


@pytest.mark.parametrize("args", [["--listen", "1", "--listen", "2", "--to", "127.0.0.1:3"]])
def test_a_listen_without_its_target_is_refused(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, str(LINKSIM), *args], capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "one --to for each --listen" in proc.stderr


def test_two_links_on_a_shared_medium_share_its_rate() -> None:
    """Two pairs in one process with --shared-mbps at the per-link rate: two payloads sent at once through the two
    take about twice one payload's time (each link alone would carry its own at the full rate)."""
    payload = bytes(range(256)) * (SIZE // 256)
    servers = [_server(b"ok") for _ in range(2)]
    ports = [free_port(), free_port()]
    pairs = [a for port, (srv, _) in zip(ports, servers, strict=True)
             for a in ("--listen", str(port), "--to", f"127.0.0.1:{srv.getsockname()[1]}")]
    proc = subprocess.Popen([sys.executable, str(LINKSIM), "--mbps", str(MBPS), "--shared-mbps", str(MBPS), *pairs],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done: list[float] = []

    def send(port: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(payload)
            c.shutdown(socket.SHUT_WR)
            while c.recv(65536):
                pass
        done.append(time.monotonic())

    try:
        for _ in ports:
            assert LISTENING.match(proc.stdout.readline())  # type: ignore[union-attr]
        start = time.monotonic()
        threads = [threading.Thread(target=send, args=(port,)) for port in ports]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        seconds = max(done) - start
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
        for srv, _ in servers:
            srv.close()
    assert [got for _, got in servers] == [[payload], [payload]]
    assert seconds >= (2 * len(payload) - 65536) / (MBPS * 1e6 / 8), seconds  # both through the one rate
    assert seconds < 10
