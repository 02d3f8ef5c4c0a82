"""`deltafin chat`: an interactive chat in the terminal, over a cluster or in-process (--local).

`ChatSession` (chat_session.py) holds the conversation and generates one reply per turn through the
Engine; the REPL here reads lines, prints the reasoning dimmed and then the answer as they stream, and a
stats line after each reply. Ctrl-C stops the reply being written; Ctrl-D quits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from typing import TYPE_CHECKING

from deltafin.cli.chat_input import open_lines, terminal_kept
from deltafin.cli.console import log_level
from deltafin.cli.flags import (
    add_cluster_options,
    add_sampling_options,
    cluster_from_args,
    sampling_from_args,
    serving_from_args,
    stage_from_args,
)
from deltafin.errors import DeltafinError, PromptTooLong
from deltafin.text.chat import EFFORTS, SERVING_EFFORT

if TYPE_CHECKING:  # the model stack loads only when a chat starts, not for --help
    from deltafin.coordinator.engine.chat_session import (  # torch: loaded when the command runs
        ChatSession,
        Reply,
    )
    from deltafin.coordinator.engine.engine import Engine  # torch: loaded when the command runs


HELP = """commands:
  /think low|high|max|off   thinking effort, or answer without thinking
  /system TEXT              set the system prompt (starts a new conversation)
  /reset                    start a new conversation
  /stats                    the workers' counters
  /exit                     quit (also Ctrl-D); Ctrl-C stops a reply
a message may be pasted whole, however long; a line that ends with \\ goes on on the next"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_cluster_options(p)
    add_sampling_options(p, temperature=0.6, max_tokens=None)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--thinking", default=SERVING_EFFORT, choices=[*EFFORTS, "off"],
                   help=f"thinking effort (default {SERVING_EFFORT})")


async def run_chat(args: argparse.Namespace) -> int:
    with terminal_kept():
        return await _chat(args)


async def _chat(args: argparse.Namespace) -> int:
    from deltafin.coordinator.engine.chat_session import (
        ChatSession,  # torch: loaded when the command runs
    )
    from deltafin.coordinator.engine.engine import open_engine  # torch: loaded when the command runs

    sampling = sampling_from_args(args)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise DeltafinError("--max-tokens must be at least 1")
    engine = await open_engine(cluster_from_args(args), stage_from_args(args), serving_from_args(args))
    if log_level(args) < 1:  # loaded: from now on (unless -v) the log would only break into the conversation
        logging.getLogger("deltafin").setLevel(logging.WARNING)
    printer = _Printer(sys.stdout.isatty())
    session = ChatSession(engine, sampling, args.max_tokens, args.system, args.thinking)
    lines = open_lines(sys.stdin)
    loop = asyncio.get_running_loop()
    current: asyncio.Task[Reply] | None = None

    def interrupt() -> None:
        if current is not None and not current.done():
            current.cancel()
        else:
            lines.stop()

    loop.add_signal_handler(signal.SIGINT, interrupt)
    print(f"chatting with {engine.model_name} (thinking {args.thinking}); /help for commands", file=sys.stderr)
    try:
        while True:
            text = await lines.next()
            if text is None:
                print()
                return 0
            text = text.strip()
            if not text:
                continue
            if text.startswith("/"):
                if await _command(text, session, engine):
                    return 0
                continue
            printer.channel = ""
            current = asyncio.create_task(session.turn(text, printer))
            try:
                reply = await current
            except asyncio.CancelledError:
                print("\n[stopped; this turn is not kept]", file=sys.stderr)
                continue
            except DeltafinError as e:  # this turn failed; the conversation so far is kept for the next
                print(f"\n[{e}; the conversation so far is kept{_what_now(e)}]", file=sys.stderr)
                continue
            finally:
                current = None
            await _show_end(reply, engine)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        await engine.close()


def _what_now(e: DeltafinError) -> str:
    if isinstance(e, PromptTooLong):
        return ": send a shorter message, or /reset to start anew"
    return ": send it again, or another message"


async def _show_end(reply: Reply, engine: Engine) -> None:
    """After a reply: its tool calls, and the stats line."""
    from deltafin.coordinator.engine.report import (  # torch: loaded when the command runs
        format_summary,
        run_summary,
    )

    print()
    for call in reply.tool_calls:
        print(f"[tool call] {call.name}({call.arguments})")
    if reply.finished is not None:
        print(format_summary(run_summary(reply.finished, await engine.worker_stats())), file=sys.stderr)


class _Printer:
    """A reply as it streams: reasoning dimmed on a terminal, a line break where the channel changes; piped, each
    channel starts with a marker ([reasoning], [answer]) where dimming cannot tell them apart."""

    def __init__(self, tty: bool):
        self.tty = tty
        self.dim, self.plain = ("\x1b[2m", "\x1b[0m") if tty else ("", "")
        self.channel = ""

    def __call__(self, kind: str, piece: str) -> None:
        if kind != self.channel:
            marker = "" if self.tty else ("[reasoning] " if kind == "reasoning" else "[answer] ")
            print(("\n" if self.channel else "") + marker, end="")
            self.channel = kind
        print(f"{self.dim}{piece}{self.plain}" if kind == "reasoning" else piece, end="", flush=True)


async def _command(text: str, session: ChatSession, engine: Engine) -> bool:
    """Run a /command; True to quit."""
    name, _, arg = text.partition(" ")
    arg = arg.strip()
    if name in ("/exit", "/quit"):
        return True
    if name == "/help":
        print(HELP, file=sys.stderr)
    elif name == "/reset":
        session.reset()
        print("[new conversation]", file=sys.stderr)
    elif name == "/think" and arg in (*EFFORTS, "off"):
        session.thinking = arg
        print(f"[thinking {arg}]", file=sys.stderr)
    elif name == "/system" and arg:
        session.system = arg
        session.reset()
        print("[system prompt set; new conversation]", file=sys.stderr)
    elif name == "/stats":
        print(json.dumps([s.as_dict() for s in await engine.worker_stats()], indent=2), file=sys.stderr)
    else:
        print(f"unknown command {text!r}\n{HELP}", file=sys.stderr)
    return False
