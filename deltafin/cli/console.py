"""What every entry point shares: its parser (a mistyped option gets a suggestion), logging levels (and progress
bars) from -q/-v/-vv, and turning errors into one line and an exit status (never a traceback for a user's
mistake)."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from deltafin.errors import DeltafinError

log = logging.getLogger("deltafin")

VERBOSE_HELP = "more logging: -v Deltafin's debug log, -vv every library's too"
QUIET_HELP = "warnings and errors only, and no progress bars"


class Parser(argparse.ArgumentParser):
    """argparse's parser, but an option it does not know gets a suggestion among those it and the command given know
    ("unrecognized arguments: --max-tokns (did you mean --max-tokens?)"), said by that command's parser (its usage).
    The parsers `add_subparsers` makes are of this class too."""

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: Any = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = self._chosen(parsed)
            known = [o for p in chosen for a in p._actions for o in a.option_strings]
            chosen[-1].error(f"unrecognized arguments: {' '.join(extras)}{did_you_mean(extras, known)}")
        return parsed

    def _chosen(self, parsed: argparse.Namespace) -> list[argparse.ArgumentParser]:
        """This parser and the parsers of the commands `parsed` names, outermost first."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                command = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(command, Parser):
                    return [self, *command._chosen(parsed)]
        return [self]


def did_you_mean(unknown: list[str], known: list[str]) -> str:
    """" (did you mean --x?)" for the unknown options close to a known one (difflib), else ""."""
    close = []
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        match = difflib.get_close_matches(flag, [k for k in known if k != flag], n=1) if flag.startswith("-") else []
        close += [(flag, match[0])] if match else []
    if len(close) == 1:
        return f" (did you mean {close[0][1]}?)"
    return f" (did you mean {', '.join(f'{m} for {f}' for f, m in close)}?)" if close else ""


def add_logging_options(p: argparse.ArgumentParser, after_command: bool = False) -> None:
    """-v/-vv and -q/--quiet, one meaning on every command (read back by `log_level`). After a command's name they
    have no defaults of their own (argparse.SUPPRESS), so that they override what came before the name rather than
    reset it."""
    verbose, quiet = (argparse.SUPPRESS, argparse.SUPPRESS) if after_command else (0, False)
    p.add_argument("-v", "--verbose", action="count", default=verbose, help=VERBOSE_HELP)
    p.add_argument("-q", "--quiet", action="store_true", default=quiet, help=QUIET_HELP)


def log_level(args: argparse.Namespace) -> int:
    """The `setup_logging` level of the options `add_logging_options` added."""
    return -1 if args.quiet else args.verbose


def setup_logging(verbose: int = 0) -> None:
    """-1 (-q): warnings and errors, and no progress bars (deltafin.progress); 0: Deltafin's progress (INFO);
    1 (-v): Deltafin's debug log too; 2 (-vv): the libraries' debug logs as well (gRPC, asyncio, zeroconf)."""
    root = logging.WARNING if verbose < 0 else logging.DEBUG if verbose >= 2 else logging.INFO
    logging.basicConfig(level=root, format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    logging.getLogger("deltafin.progress").setLevel(logging.WARNING if verbose < 0 else logging.NOTSET)
    if verbose == 1:
        logging.getLogger("deltafin").setLevel(logging.DEBUG)


def run_cli(main_fn: Callable[[], int]) -> int:
    """Run an entry point: DeltafinError -> one line and exit 1; Ctrl-C -> exit 130; anything else is a bug:
    one line too, with the traceback in the debug log (-v)."""
    try:
        return main_fn()
    except DeltafinError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:
        log.debug("unexpected error", exc_info=True)
        print(f"error: unexpected {type(e).__name__}: {e} (run with -v for details; please report it)",
              file=sys.stderr)
        return 1


def stop_on_signals(what: str) -> asyncio.Event:
    """An event the first SIGINT or SIGTERM sets (the process then stops gracefully); a second one ends it at
    once, status 130 (a graceful stop that takes too long must not need SIGKILL). Call inside the running loop."""
    stop = asyncio.Event()

    def heard(sig: signal.Signals) -> None:
        if stop.is_set():
            print(f"{what}: {sig.name} again: exiting now", file=sys.stderr, flush=True)
            os._exit(130)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, heard, sig)
    return stop
