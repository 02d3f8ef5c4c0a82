"""Finding the memory a process may use: cgroup v1 and v2 limits up the hierarchy, the Mac's branches with the
platform monkeypatched, and the safety margins."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deltafin.runtime import memory
from deltafin.runtime.memory import MARGIN, MemoryFound, cgroup_limit, find_memory, peak_rss


def _files(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_cgroup_v1_takes_the_tightest_ancestor(tmp_path):
    _files(tmp_path, {"proc": "9:pids:/\n4:memory:/outer/inner\n1:cpu:/\n",
                      "cg/memory/outer/inner/memory.limit_in_bytes": "5368709120\n",
                      "cg/memory/outer/memory.limit_in_bytes": "3221225472\n",
                      "cg/memory/memory.limit_in_bytes": "9223372036854771712\n"})  # the root: unlimited
    assert cgroup_limit(tmp_path / "proc", tmp_path / "cg") == 3 << 30


def test_cgroup_v2_reads_memory_max(tmp_path):
    _files(tmp_path, {"proc": "0::/user.slice/job.scope\n", "cg/user.slice/job.scope/memory.max": "max\n",
                      "cg/user.slice/memory.max": "2147483648\n"})
    assert cgroup_limit(tmp_path / "proc", tmp_path / "cg") == 2 << 30


def test_no_limit_anywhere(tmp_path):
    _files(tmp_path, {"proc": "0::/a\n", "cg/a/memory.max": "max\n"})
    assert cgroup_limit(tmp_path / "proc", tmp_path / "cg") is None
    assert cgroup_limit(tmp_path / "missing", tmp_path / "cg") is None


def test_host_memory_is_the_least_of_ram_available_and_cgroup(monkeypatch):
    monkeypatch.setattr(memory, "_physical_ram", lambda: 64 * 10**9)
    monkeypatch.setattr(memory, "_meminfo", lambda key: 40 * 10**9)
    monkeypatch.setattr(memory, "_own_rss", lambda: 10**9)
    monkeypatch.setattr(memory, "cgroup_limit", lambda: None)
    assert memory.host_memory() == (41 * 10**9, "available RAM 40.0 GB")
    monkeypatch.setattr(memory, "cgroup_limit", lambda: 16 << 30)
    assert memory.host_memory() == (16 << 30, "cgroup memory limit 17.2 GB")


def test_a_mac_uses_metals_working_set_and_sysctl(monkeypatch):
    """darwin: physical RAM from `sysctl hw.memsize`, the budget from Metal's recommended working set."""
    monkeypatch.setattr(memory.sys, "platform", "darwin")
    calls = []

    def sysctl(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="68719476736\n", stderr="")

    monkeypatch.setattr(subprocess, "run", sysctl)
    monkeypatch.setattr(memory, "_meminfo", lambda key: None)  # no /proc/meminfo on macOS
    monkeypatch.setattr(memory, "cgroup_limit", lambda: None)
    assert memory._physical_ram() == 64 << 30 and calls == [["sysctl", "-n", "hw.memsize"]]
    monkeypatch.setattr(memory, "mps_working_set", lambda: 48 << 30)
    found = find_memory("mps")
    assert found.device == 48 << 30 and found.host is None and "Metal recommended working set" in found.source
    assert found.budget == (int((48 << 30) * (1 - MARGIN["host"])), None)
    monkeypatch.setattr(memory, "mps_working_set", lambda: None)  # an older torch: the RAM, as on a CPU
    assert find_memory("mps").device == 64 << 30


def test_margins():
    assert MemoryFound(100, None, "").budget == (90, None)
    assert MemoryFound(1000, 100, "").budget == (950, 90)  # a GPU keeps 5%, its host 10%


@pytest.mark.parametrize("value", ["", "garbage"])
def test_unreadable_limits_are_ignored(tmp_path, value):
    _files(tmp_path, {"proc": "4:memory:/x\n", "cg/memory/x/memory.limit_in_bytes": value})
    assert cgroup_limit(tmp_path / "proc", tmp_path / "cg") is None


def test_a_process_s_peak_is_its_own_not_the_parent_s_it_forked_from():
    """ru_maxrss survives fork and exec on Linux: a worker started by a test runner of 1.5 GB reported a peak of
    1.5 GB before it loaded anything (a test then failed only in the full suite). peak_rss is the process's own."""
    ballast = bytearray(1_500_000_000)  # this process holds 1.5 GB when it forks the child
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # touched: resident
    child = subprocess.run([sys.executable, "-c", "from deltafin.runtime.memory import peak_rss; print(peak_rss())"],
                           capture_output=True, text=True, check=True)
    assert peak_rss() >= 1_500_000_000 > 2 * int(child.stdout)
    del ballast
