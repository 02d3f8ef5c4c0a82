"""Logging levels of the command lines: -q, the default, -v and -vv."""

from __future__ import annotations

import subprocess
import sys


def test_quiet_default_verbose_and_very_verbose_logging() -> None:
    script = ("import logging, sys; from deltafin.cli.console import setup_logging; setup_logging(int(sys.argv[1])); "
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


def test_every_command_line_takes_the_logging_options_before_or_after_the_command() -> None:
    from deltafin.cli.commands import build_parser as deltafin_parser
    from deltafin.cli.console import log_level
    from deltafin.coordinator.main import build_parser as coordinator_parser
    from deltafin.worker.main import build_parser as worker_parser

    deltafin = deltafin_parser().parse_args
    assert log_level(deltafin(["tokenize", "--model", "M", "hi"])) == 0
    assert log_level(deltafin(["tokenize", "--model", "M", "hi", "-vv"])) == 2
    assert log_level(deltafin(["-vv", "bench", "--model", "M"])) == 2  # not reset by the command's own options
    assert log_level(deltafin(["-v", "synth", "--preset", "tiny", "--out", "D", "-q"])) == -1
    synth = deltafin(["synth", "--preset", "tiny", "--out", "D", "--quiet"])  # synth's own: its progress bar
    assert synth.quiet and log_level(synth) == 0
    coordinator = coordinator_parser().parse_args
    assert log_level(coordinator(["generate", "hi", "-v"])) == 1
    assert log_level(coordinator(["-v", "generate", "hi"])) == 1
    assert log_level(coordinator(["-q", "generate", "hi"])) == -1
    assert log_level(worker_parser().parse_args(["--model", "M", "-vv"])) == 2
