"""What every entry point shares: logging levels (and progress bars) from -q/-v/-vv, and turning errors into one
line and an exit status (never a traceback for a user's mistake)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable

from deltafin.errors import DeltafinError

log = logging.getLogger("deltafin")

VERBOSE_HELP = "more logging: -v Deltafin's debug log, -vv every library's too"
QUIET_HELP = "warnings and errors only, and no progress bars"


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
