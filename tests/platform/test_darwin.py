"""The macOS-only branches, run here with the platform monkeypatched: F_NOCACHE reads, reads into MLX slots,
Bonjour's interfaces, the launchd plist (Apple clang's flags and Metal's working set:
tests/deltafin/kernels/test_cpu.py, tests/deltafin/runtime/test_memory.py)."""

from __future__ import annotations

import os
import plistlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from deltafin.transport import discovery
from deltafin.weights import directio

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_direct_io_on_macos_is_f_nocache(tmp_path, monkeypatch):
    """macOS has no O_DIRECT: the file opens plainly and F_NOCACHE (fcntl 48) turns the page cache off."""
    import fcntl

    calls = []
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(fcntl, "fcntl", lambda fd, cmd, arg: calls.append((cmd, arg)) or 0)
    (tmp_path / "f").write_bytes(b"x" * 10)
    fd, direct = directio.open_file(tmp_path / "f", os.O_RDONLY, True)
    os.close(fd)
    assert direct and calls == [(directio.F_NOCACHE, 1)] and directio.F_NOCACHE == 48
    fd, direct = directio.open_file(tmp_path / "f", os.O_RDONLY, False)  # buffered when asked
    os.close(fd)
    assert not direct and len(calls) == 1


def test_reads_into_mlx_slots_bypass_the_cache_only_on_macos(monkeypatch):
    from deltafin.weights.mlx_slots import unaligned_io

    monkeypatch.setattr(sys, "platform", "darwin")
    assert unaligned_io("direct") == "direct"  # F_NOCACHE takes unaligned reads
    monkeypatch.setattr(sys, "platform", "linux")
    assert unaligned_io("direct") == "buffered"  # O_DIRECT does not


def test_bonjour_on_macos_leaves_peer_to_peer_wifi_and_tunnels_alone(monkeypatch):
    import ifaddr

    adapters = [SimpleNamespace(nice_name=n, ips=[SimpleNamespace(ip=ip)]) for n, ip in
                [("lo0", "127.0.0.1"), ("en0", "192.168.1.20"), ("awdl0", "169.254.1.1"), ("llw0", "169.254.1.2"),
                 ("utun3", "10.8.0.2"), ("bridge0", "169.254.7.7"), ("en0", ("fe80::1", 0, 4))]]
    monkeypatch.setattr(ifaddr, "get_adapters", lambda: adapters)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert discovery.default_interfaces() == ["192.168.1.20", "169.254.7.7"]  # Wi-Fi/Ethernet, Thunderbolt
    monkeypatch.setattr(sys, "platform", "linux")
    assert discovery.default_interfaces() is None  # every interface


def test_the_launchd_plist_starts_a_worker_the_cli_accepts():
    from deltafin.cli.worker import build_parser

    plist = plistlib.loads((DEPLOY / "com.deltafin.worker.plist").read_bytes())
    assert plist["Label"] == "com.deltafin.worker" and plist["RunAtLoad"] and plist["KeepAlive"]
    program, *args = plist["ProgramArguments"]
    assert program.endswith("/deltafin-worker")
    parsed = build_parser().parse_args(args)
    assert parsed.device == "mps" and parsed.memory_gb == 56 and parsed.cluster_key_file


def test_the_systemd_unit_starts_a_worker_the_cli_accepts():
    import shlex

    from deltafin.cli.worker import build_parser

    line = next(x for x in (DEPLOY / "deltafin-worker.service").read_text().splitlines() if x.startswith("ExecStart"))
    program, *args = shlex.split(line.split("=", 1)[1].replace("%H", "host"))
    assert program.endswith("/deltafin-worker")
    assert build_parser().parse_args(args).memory_gb == 56


@pytest.mark.parametrize("platform_name, factor", [("darwin", 1), ("linux", 1024)])
def test_peak_rss_units_follow_the_platform(monkeypatch, tmp_path, platform_name, factor):
    """Where there is no /proc (macOS), getrusage's ru_maxrss: bytes on macOS and KiB on Linux."""
    import resource

    from deltafin.runtime.memory import peak_rss

    monkeypatch.setattr(sys, "platform", platform_name)
    monkeypatch.setattr(resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=1000))
    assert peak_rss(tmp_path / "no-proc-status") == 1000 * factor


def test_device_auto_on_apple_silicon_is_mps_with_mlx_experts(monkeypatch):
    """The Mac's plan (README, Apple silicon): the spine on MPS, the routed experts on MLX."""
    import torch

    from deltafin.devices import resolve_device
    from deltafin.kernels import linear

    pytest.importorskip("mlx.core", reason="the test extra installs mlx[cpu]")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_device("auto").type == "mps"
    linear.select_kernels("auto")
    assert linear.expert_backend("mps") == "mlx" and linear.expert_backend("cpu") == "torch"
