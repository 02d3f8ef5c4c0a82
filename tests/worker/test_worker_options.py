"""The worker daemon's typed options: `deltafin-worker`'s flags build them (the stage's among them, with the same
rule as every command's), and what makes no sense is refused when they are built, naming the flag."""

from __future__ import annotations

import pytest

from deltafin.cli.worker import build_parser
from deltafin.errors import DeltafinError
from deltafin.worker.worker_options import WorkerOptions


def _options(*flags: str) -> WorkerOptions:
    return WorkerOptions.of(vars(build_parser().parse_args(["--model", "k3-mini", *flags])))


def test_the_flags_build_the_worker_s_and_its_stages_options() -> None:
    o = _options("--host", "0.0.0.0", "--port", "7070", "--advertise", "10.0.0.2:7070", "--advertise", "mac.local:7",
                 "--no-announce", "--disk-gbps", "6.6,2", "--memory-gb", "48", "--spine", "int8", "--read-threads",
                 "4", "--expert-dir", "/a", "--session-ttl", "60", "--max-message-mb", "64")
    assert (o.host, o.port, o.announce, o.session_ttl) == ("0.0.0.0", 7070, False, 60.0)
    assert o.advertise == ("10.0.0.2:7070", "mac.local:7")
    assert o.max_message == 64 << 20 and not o.loopback and o.given_disk_speeds(2) == (6.6, 2.0)
    assert (o.stage.memory_bytes, o.stage.sizing.spine, o.stage.sizing.read_threads, o.stage.expert_dir) == (
        48_000_000_000, "int8", 4, ("/a",))
    defaults = _options()
    assert defaults.loopback and defaults.announce and defaults.given_disk_speeds(1) is None
    assert defaults.stage.expert_heat_dir is not None  # the stage's rule: heat remembered unless --no-expert-heat


@pytest.mark.parametrize("flags, said", [
    (("--tls-cert", "c.pem"), "--tls-cert and --tls-key go together"),
    (("--tls-client-ca", "ca.pem"), "--tls-client-ca and --tls-ca need --tls-cert"),
    (("--advertise", "nohost"), "--advertise 'nohost': HOST:PORT expected"),
    (("--disk-gbps", "fast"), "--disk-gbps takes numbers"),
    (("--disk-gbps", "1,2,3"), "--disk-gbps gives 3 speeds for 1 disks"),
    (("--port", "70000"), "--port must be 0-65535"),
    (("--session-ttl", "0"), "--session-ttl"),
])
def test_what_makes_no_sense_is_refused_naming_the_flag(flags: tuple[str, ...], said: str) -> None:
    with pytest.raises(DeltafinError, match=said.replace("(", r"\(")):
        _options(*flags)
