"""Logging levels of the command lines: -q, the default, -v and -vv."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest


def every_parser() -> list[argparse.ArgumentParser]:
    """The three entry points' parsers and each of their commands'."""
    from deltafin.cli.commands import build_parser as deltafin_parser
    from deltafin.cli.coordinator import build_parser as coordinator_parser
    from deltafin.cli.worker import build_parser as worker_parser

    tops = [deltafin_parser(), coordinator_parser(), worker_parser()]
    commands = [c for p in tops for a in p._actions if isinstance(a, argparse._SubParsersAction)
                for c in a.choices.values()]
    return tops + commands


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
    from deltafin.cli.coordinator import build_parser as coordinator_parser
    from deltafin.cli.worker import build_parser as worker_parser

    deltafin = deltafin_parser().parse_args
    assert log_level(deltafin(["tokenize", "--model", "M", "hi"])) == 0
    assert log_level(deltafin(["tokenize", "--model", "M", "hi", "-vv"])) == 2
    assert log_level(deltafin(["-vv", "bench", "--model", "M"])) == 2  # not reset by the command's own options
    assert log_level(deltafin(["-v", "synth", "--preset", "tiny", "--out", "D", "-q"])) == -1
    coordinator = coordinator_parser().parse_args
    assert log_level(coordinator(["generate", "hi", "-v"])) == 1
    assert log_level(coordinator(["-v", "generate", "hi"])) == 1
    assert log_level(coordinator(["-q", "generate", "hi"])) == -1
    assert log_level(worker_parser().parse_args(["--model", "M", "-vv"])) == 2


def test_quiet_is_one_flag_with_one_meaning_on_every_command() -> None:
    """-q and --quiet are the same flag everywhere (synth, download and convert once had a --quiet of their own
    that only hid the progress bar, while -q was deltafin's --quiet-logs)."""
    from deltafin.cli.commands import build_parser as deltafin_parser
    from deltafin.cli.console import QUIET_HELP, log_level
    from deltafin.cli.coordinator import build_parser as coordinator_parser
    from deltafin.cli.worker import build_parser as worker_parser

    deltafin = deltafin_parser().parse_args
    for command in (["synth", "--preset", "tiny", "--out", "D"], ["download", "hf:o/m"], ["convert", "--model", "M"],
                    ["tokenize", "--model", "M", "hi"]):
        for flag in ("-q", "--quiet"):
            assert log_level(deltafin([*command, flag])) == -1 and log_level(deltafin([flag, *command])) == -1
    assert log_level(coordinator_parser().parse_args(["--model", "M", "serve", "--quiet"])) == -1
    assert log_level(worker_parser().parse_args(["--model", "M", "--quiet"])) == -1
    for parser in every_parser():
        quiet = [a for a in parser._actions if "-q" in a.option_strings]
        assert [(a.option_strings, a.help) for a in quiet] == [(["-q", "--quiet"], QUIET_HELP)], parser.prog


def test_quiet_silences_the_progress_bar_on_a_terminal_too() -> None:
    script = ("import io, sys; from deltafin.cli.console import setup_logging; from deltafin.progress import Progress\n"
              "class T(io.StringIO):\n    def isatty(self): return True\n"
              "setup_logging(int(sys.argv[1])); t = T()\n"
              "with Progress(10, 'work', stream=t) as bar: bar.update(10)\n"
              "print(repr(t.getvalue()))")

    def drawn(level: int) -> str:
        return subprocess.run([sys.executable, "-c", script, str(level)], capture_output=True, text=True, timeout=60,
                              check=True).stdout.strip()

    assert "work: 100.0%" in drawn(0) and drawn(-1) == "''"


def test_a_mistyped_option_gets_a_suggestion_on_every_entry_point(capsys) -> None:
    from deltafin.cli.commands import main as deltafin
    from deltafin.cli.console import Parser
    from deltafin.cli.coordinator import main as coordinator
    from deltafin.cli.worker import main as worker

    assert all(isinstance(p, Parser) for p in every_parser())  # one helper behind every parser and command
    cases = [(deltafin, ["tokenize", "--model", "M", "hi", "--alow-special"],
              "deltafin tokenize: error: unrecognized arguments: --alow-special (did you mean --allow-special?)"),
             (deltafin, ["serve", "--prot", "8000"],
              "deltafin serve: error: unrecognized arguments: --prot 8000 (did you mean --port?)"),
             (coordinator, ["--model", "M", "generate", "hi", "--max-tokns", "3"],
              "deltafin-coordinator generate: error: unrecognized arguments: --max-tokns 3 (did you mean "
              "--max-tokens?)"),
             (worker, ["--model", "M", "--max-mesage-mb=3"],
              "deltafin-worker: error: unrecognized arguments: --max-mesage-mb=3 (did you mean --max-message-mb?)")]
    for main, argv, line in cases:
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == line


def test_did_you_mean_names_each_close_option_and_nothing_for_the_rest() -> None:
    from deltafin.cli.console import did_you_mean

    known = ["--max-tokens", "--temperature", "--top-p", "-q", "--quiet"]
    assert did_you_mean(["--max-token"], known) == " (did you mean --max-tokens?)"
    assert did_you_mean(["--temprature=0.5", "extra", "--max-tokns"], known) == \
        " (did you mean --temperature for --temprature, --max-tokens for --max-tokns?)"
    assert did_you_mean(["--colour", "words"], known) == ""
    assert did_you_mean(["--quiet"], known) == ""  # known (given at the wrong level): no suggestion of itself
