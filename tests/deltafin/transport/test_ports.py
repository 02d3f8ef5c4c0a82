"""A server that cannot listen says why and what to do: checked against real sockets on loopback."""

from __future__ import annotations

import socket

import pytest

from deltafin.errors import DeltafinError
from deltafin.transport.ports import cannot_listen, check_free


@pytest.fixture
def taken() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_port_in_use_names_the_address_and_the_way_out(taken: int) -> None:
    e = cannot_listen("127.0.0.1", taken, "this worker")
    assert f"127.0.0.1:{taken} is already in use" in str(e) and "--port 0 picks a free one" in str(e)
    with pytest.raises(DeltafinError, match="already in use"):
        check_free("127.0.0.1", taken, "the API")


def test_an_address_of_another_machine_and_a_free_port() -> None:
    e = cannot_listen("192.0.2.1", 8000, "the API")  # TEST-NET-1: never an address of this machine
    assert "not an address of this machine" in str(e)
    check_free("127.0.0.1", 0, "the API")  # a free port: nothing raised


def test_a_worker_on_a_taken_port_exits_with_the_reason(taken: int, tiny_dir) -> None:
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "deltafin.cli.worker", "--model", str(tiny_dir), "--port",
                          str(taken), "--no-announce", "--memory-gb", "2"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    assert f"127.0.0.1:{taken} is already in use" in run.stderr and "please report" not in run.stderr
    assert "Failed to add port" not in run.stderr  # asked before gRPC tries, whose C core would log its own line


def test_a_worker_address_is_host_colon_port_or_one_line_saying_so() -> None:
    from deltafin.transport.ports import check_address

    for good in ("localhost:7070", "10.0.0.2:1", "mac-studio.local:65535", "[::1]:7070", "[fe80::1%en0]:50051"):
        assert check_address(good) == good
    for bad in ("localhost7070", "localhost:", ":7070", "localhost:0", "localhost:65536", "localhost:70a",
                "::1:7070", "[::1]7070", "[10.0.0.1]:7070", "[nonsense]:7070", "my host:7070", "http://h:7070", ""):
        with pytest.raises(DeltafinError) as e:
            check_address(bad)
        assert str(e.value) == f"--worker {bad!r}: HOST:PORT expected (port 1-65535; IPv6 as [::1]:7070)"
