"""`deltafin`'s commands as a newcomer meets them: `deltafin serve` runs the bundled model on this machine alone
and names itself so in its help and errors, which list every route it serves; a coordinator that finds no worker
says how to run alone."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request

import pytest

from tests.support.cluster import COORDINATOR

DELTAFIN = [sys.executable, "-m", "deltafin"]


def test_deltafin_serve_runs_the_bundled_model_alone() -> None:
    server = subprocess.Popen([*DELTAFIN, "serve", "--port", "0", "--device", "cpu", "-q"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()  # type: ignore[union-attr]
        m = re.search(r"serving (http://[\d.]+:\d+) \(model 'k3-mini'", line)
        assert m, line + server.stderr.read()  # type: ignore[union-attr]
        card = json.loads(urllib.request.urlopen(m.group(1) + "/v1/models", timeout=30).read())["data"][0]
        # its context: the model's own (1,048,576), or the longest this machine's memory holds beside the plan
        assert card["id"] == "k3-mini" and 4096 < card["context_length"] <= 1 << 20
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0


def test_a_coordinator_with_no_worker_says_how_to_run_alone() -> None:
    r = subprocess.run([*COORDINATOR, "--model", "k3-mini", "--interface", "127.0.0.1", "--discover-timeout", "0.5",
                        "plan"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "no workers" in r.stderr and "add --local (or use `deltafin serve`" in r.stderr


def _help(main, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


def test_serve_help_names_the_command_and_lists_every_route_the_server_has(capsys) -> None:
    from deltafin.cli.commands import main as deltafin
    from deltafin.cli.coordinator import main as coordinator
    from deltafin.coordinator.http.server import create_app

    routes = {r.resource.canonical for r in create_app(None).router.routes()}  # type: ignore[arg-type]
    assert {"/v1/chat/completions", "/v1/responses", "/api/chat", "/metrics", "/health", "/"} <= routes
    for main, argv, prog in [(deltafin, ["serve", "--help"], "deltafin serve"),
                             (deltafin, ["-q", "serve", "--help"], "deltafin serve"),
                             (coordinator, ["serve", "--help"], "deltafin-coordinator serve")]:
        text = _help(main, argv, capsys)
        assert text.startswith(f"usage: {prog} [-h]"), text[:200]
        assert routes - {word.strip("(),;:.'") for word in text.split()} == set(), prog


def test_serve_errors_name_deltafin_serve(capsys) -> None:
    from deltafin.cli.commands import main as deltafin

    with pytest.raises(SystemExit) as done:
        deltafin(["serve", "--port", "eighty"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "deltafin-coordinator" not in err
    assert err.startswith("usage: deltafin serve") and "deltafin serve: error: argument --port: invalid int" in err


def test_inspect_exits_1_when_the_memory_plan_cannot_fit(capsys) -> None:
    """`inspect --memory-gb 0.1` printed "cannot fit", then "no problems found", and exited 0: it says the least
    the plan needs and exits 1, and "no problems found" stays for a plan that fits."""
    from deltafin.cli.commands import main as deltafin

    assert deltafin(["-q", "inspect", "--model", "k3-mini", "--memory-gb", "0.1"]) == 1
    out = capsys.readouterr().out
    assert "memory plan: layers 0-7 cannot fit on cpu: they need at least 1." in out, out
    assert "more workers" not in out and "no problems found" not in out
    assert deltafin(["-q", "inspect", "--model", "k3-mini", "--memory-gb", "0.1", "--json"]) == 1
    assert "cannot fit" in json.loads(capsys.readouterr().out)["plan"]["error"]
    assert deltafin(["-q", "inspect", "--model", "k3-mini", "--memory-gb", "2"]) == 0
    assert "no problems found" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["inspect"], ["bench", "--no-disk"], ["logits", "--ids", "1,2", "--out", "x.npy"],
                                  ["chat", "--local"], ["serve", "--port", "0"]], ids=lambda a: a[0])
def test_a_memory_budget_of_nothing_is_refused_naming_its_flag(argv, capsys) -> None:
    from deltafin.cli.commands import main as deltafin

    assert deltafin(["-q", *argv, "--model", "k3-mini", "--memory-gb", "0"]) == 1
    assert capsys.readouterr().err.strip() == "error: --memory-gb must be more than 0"
