"""Helpers for tests that run real worker processes on the loopback interface."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

# The entry points as commands of this interpreter (so a test runs the checkout it imports).
WORKER = [sys.executable, "-m", "deltafin.cli.worker"]
COORDINATOR = [sys.executable, "-m", "deltafin.cli.coordinator"]

LISTENING = re.compile(r"listening on ([\d.]+):(\d+)")
_LOGS = tempfile.TemporaryDirectory(prefix="deltafin-test-logs-")  # the processes' logs, removed at exit


def _start(cmd: list[str], what: str) -> tuple[subprocess.Popen, Path]:
    """`cmd` with its log (stderr) in a file, never a pipe: a pipe nobody reads fills after ~64 KB of log and then
    blocks the process at its next log line (a long fuzz run wedged a worker that way). Stdout stays a pipe, for
    the line that says where it listens."""
    fd, log = tempfile.mkstemp(prefix=f"{what}-", suffix=".log", dir=_LOGS.name)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=fd, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        os.close(fd)
    return proc, Path(log)


class WorkerProcess:
    """A worker on 127.0.0.1. `name=None` leaves the default (the host name); `memory_gb=None` leaves the budget
    to the worker (the memory it finds); `prefix` runs it under a wrapper (e.g. memlimit)."""

    def __init__(self, model: Path, name: str | None, *extra: str, announce: bool = False,
                 memory_gb: float | None = 4, prefix: tuple[str, ...] = ()):
        # every worker its own prefix folder (tests must not resume each other's kept prefixes)
        self.prefix_dir = tempfile.mkdtemp(prefix="deltafin-prefixes-")
        atexit.register(shutil.rmtree, self.prefix_dir, ignore_errors=True)  # a restarted worker may reuse it
        cmd = [*prefix, *WORKER, "--model", str(model), "--port", "0", "--prefix-dir", self.prefix_dir,
               "--disk-gbps", "2.0", "--grace", "3", *extra]
        cmd += ["--name", name] if name is not None else []
        cmd += ["--memory-gb", str(memory_gb)] if memory_gb is not None else []
        cmd += ["--interface", "127.0.0.1"] if announce else ["--no-announce"]
        self.name = name or "default"
        self.wrapped = bool(prefix)
        self.proc, self.log_path = _start(cmd, "worker")
        self.address = ""

    def log(self) -> str:
        """What the worker has logged so far (its stderr)."""
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker {self.name} exited: {self.log()}")
                continue
            m = LISTENING.search(line)
            if m:
                self.address = f"{m.group(1)}:{m.group(2)}"
                return self.address
        raise TimeoutError(f"worker {self.name} did not start")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Signal the worker (under wrappers, the process at the bottom of them: each wrapper then exits with the
        worker's status) and wait; returns the exit status."""
        if self.proc.poll() is None:
            targets = _leaves(self.proc.pid) if self.wrapped else []
            for pid in targets:
                os.kill(pid, sig)
            if not targets:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


def _leaves(pid: int) -> list[int]:
    """The processes at the bottom of `pid`'s tree (a wrapper's wrapper's command: memlimit -- disklimit -- CMD)."""
    children = _children(pid)
    return [leaf for c in children for leaf in (_leaves(c) or [c])]


@contextmanager
def workers(model: Path, n: int, *extra: str, announce: bool = False, prefix: str = "w"):
    procs = [WorkerProcess(model, f"{prefix}{i}", *extra, announce=announce) for i in range(n)]
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


SERVING = re.compile(r"serving (http://[\d.]+:\d+)")


class ServerProcess:
    """`deltafin-coordinator ... serve --port 0` as a subprocess (under the `wrap` command, if any); `url` once
    it is ready."""

    def __init__(self, model: Path, *args: str, serve_args: tuple[str, ...] = (), wrap: tuple[str, ...] = ()):
        cmd = [*wrap, *COORDINATOR, "--model", str(model), "--no-discover", "-q",
               *args, "serve", "--port", "0", *serve_args]
        self.proc, self.log_path = _start(cmd, "serve")
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        m = SERVING.search(line)
        if not m:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"server did not start: {line}{self.log()}")
        self.url = m.group(1)
        self.wrapped = bool(wrap)

    def log(self) -> str:
        """What the server has logged so far (its stderr)."""
        return self.log_path.read_text()

    def stop(self) -> int:
        """SIGTERM to the server (under wrappers, to the process at the bottom of them: a wrapper such as memlimit
        does not pass signals on) and wait; returns the exit status."""
        if self.proc.poll() is None:
            targets = _leaves(self.proc.pid) if self.wrapped else []
            for pid in targets:
                os.kill(pid, signal.SIGTERM)
            if not targets:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


TOOLS = Path(__file__).resolve().parents[3] / "shared" / "tools"  # memlimit and disklimit (../shared/tools)


def memlimit(gb: float | None) -> tuple[str, ...]:
    """The wrapper that caps a process's memory and page cache at `gb` (caches dropped first); none for None."""
    return (str(TOOLS / "memlimit"), f"{int(gb * 1024)}M", "--drop-caches", "--") if gb else ()


def restarted_servers(model: Path, *args: str, runs: int, wrap: tuple[str, ...] = ()):
    """`runs` servers of the same options one after another (a restart between each), each stopped when the loop
    takes the next."""
    for _ in range(runs):
        server = ServerProcess(model, *args, wrap=wrap)
        try:
            yield server
        finally:
            server.stop()


def split_at_dashes(argv: list[str]) -> tuple[list[str], list[str]]:
    """A bench's own arguments and, after `--`, the coordinator's."""
    return (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def http_get(url: str, headers: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, str]:
    """(status, body) of a GET, error statuses included."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def timed_stream(url: str, route: str, body: dict, text_of: Callable[[dict], str]) -> dict:
    """One streamed request to a server's OpenAI `route` (the served model filled in, usage asked for): the time to
    its first text, the text (`text_of` a choice) and the usage it reported."""
    import json
    import urllib.request

    _, models = http_get(f"{url}/v1/models")
    body = {"model": json.loads(models)["data"][0]["id"], "stream": True,
            "stream_options": {"include_usage": True}, **body}
    request = urllib.request.Request(f"{url}{route}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0, first, text, usage = time.perf_counter(), None, [], {}
    with urllib.request.urlopen(request, timeout=7200) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for piece in filter(None, map(text_of, chunk.get("choices", ()))):
                first = first if first is not None else time.perf_counter() - t0
                text.append(piece)
    return {"ttft_s": round(first or 0.0, 3), "text": "".join(text), "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}
