"""The command lines' conventions: options before or after the command, -q/-v/-vv, errors as one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

COORDINATOR = [sys.executable, "-m", "deltafin.coordinator.main"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*COORDINATOR, *args], capture_output=True, text=True, timeout=300)


def test_cluster_options_go_before_or_after_the_command(tiny_dir: Path) -> None:
    before = _run("--model", str(tiny_dir), "--local", "-q", "generate", "hi", "--max-tokens", "3", "--json")
    after = _run("generate", "hi", "--max-tokens", "3", "--json", "--model", str(tiny_dir), "--local", "-q")
    assert before.returncode == after.returncode == 0, before.stderr + after.stderr
    assert json.loads(before.stdout)["ids"] == json.loads(after.stdout)["ids"]
    # given on both sides, the one after the command wins
    mixed = _run("--model", "/nonexistent", "generate", "hi", "--max-tokens", "1", "--model", str(tiny_dir),
                 "--local", "-q")
    assert mixed.returncode == 0, mixed.stderr
    missing = _run("generate", "hi", "--local")
    assert missing.returncode == 2 and "--model" in missing.stderr and "Traceback" not in missing.stderr


def test_quiet_default_verbose_and_very_verbose_logging() -> None:
    script = ("import logging, sys; from deltafin.console import setup_logging; setup_logging(int(sys.argv[1])); "
              "ours = logging.getLogger('deltafin.x'); ours.debug('ours-debug'); ours.info('ours-info'); "
              "logging.getLogger('grpc').debug('lib-debug'); ours.warning('ours-warning')")

    def seen(level: int) -> list[str]:
        done = subprocess.run([sys.executable, "-c", script, str(level)], capture_output=True, text=True,
                              timeout=60, check=True)
        return [line.split()[-1] for line in done.stderr.splitlines()]

    assert seen(-1) == ["ours-warning"]
    assert seen(0) == ["ours-info", "ours-warning"]
    assert seen(1) == ["ours-debug", "ours-info", "ours-warning"]
    assert seen(2) == ["ours-debug", "ours-info", "lib-debug", "ours-warning"]
