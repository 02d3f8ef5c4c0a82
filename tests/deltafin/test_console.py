"""Logging levels of the command lines: -q, the default, -v and -vv."""

from __future__ import annotations

import subprocess
import sys


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
