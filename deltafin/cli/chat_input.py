"""What `deltafin chat` reads: one message at a time, delivered to the event loop from a daemon thread (so quitting
never waits on a read).

In a terminal the message is read with readline: line editing and history, and no length limit (the terminal's own
line mode cuts a line at its buffer, 4,096 bytes on Linux and 1,024 on macOS, silently: readline reads keys, not
lines). A multi-line paste is one message where the terminal supports bracketed paste; a line that ends with a
backslash goes on on the next (`...> `). Piped, each line is a message, and no prompt is printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

PROMPT, MORE = "you> ", "...> "
CONTINUES = "\\"  # a line that ends with it goes on on the next


class Lines:
    """Messages from a pipe (or any stream): a line each."""

    def __init__(self, stream: TextIO):
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def read() -> None:
            for line in stream:
                loop.call_soon_threadsafe(self.queue.put_nowait, line.rstrip("\n"))
            loop.call_soon_threadsafe(self.queue.put_nowait, None)

        threading.Thread(target=read, name="deltafin-chat-stdin", daemon=True).start()

    async def next(self) -> str | None:
        """The next message; None at the end of the input (or when `stop` was called)."""
        print(PROMPT, end="", flush=True)
        return await self.queue.get()

    def stop(self) -> None:
        self.queue.put_nowait(None)


class TerminalLines(Lines):
    """Messages typed or pasted into a terminal, read with readline when asked for (so that its prompt comes after
    the reply before it)."""

    def __init__(self) -> None:
        import readline  # lazily: input() edits lines once it is loaded; absent on some platforms

        _bind(readline, "set enable-bracketed-paste on")  # a multi-line paste arrives as one message
        self.queue = asyncio.Queue()
        self.asks: queue.Queue[str] = queue.Queue()
        loop = asyncio.get_running_loop()

        def read() -> None:
            while True:
                prompt = self.asks.get()
                try:
                    message = _message(prompt)
                except EOFError:
                    message = None
                loop.call_soon_threadsafe(self.queue.put_nowait, message)

        threading.Thread(target=read, name="deltafin-chat-readline", daemon=True).start()

    async def next(self) -> str | None:
        self.asks.put(PROMPT)
        return await self.queue.get()


def _message(prompt: str) -> str:
    """One message from input(): lines that end with CONTINUES joined with the next."""
    parts = [input(prompt)]
    while parts[-1].endswith(CONTINUES):
        parts[-1] = parts[-1][:-len(CONTINUES)]
        parts.append(input(MORE))
    return "\n".join(parts)


def _bind(readline: object, line: str) -> None:
    with contextlib.suppress(Exception):  # libedit (some Pythons on macOS) knows no such setting: nothing lost
        readline.parse_and_bind(line)  # type: ignore[attr-defined]


def open_lines(stream: TextIO) -> Lines:
    """A terminal's messages through readline (a plain line each where readline is missing), a pipe's a line each."""
    if stream.isatty():
        try:
            return TerminalLines()
        except ImportError:
            pass
    return Lines(stream)


@contextlib.contextmanager
def terminal_kept(stream: TextIO = sys.stdin) -> Iterator[None]:
    """The terminal's settings as they were on entry, again on exit: quitting while readline holds the terminal
    in its own mode must not leave the shell without echo."""
    try:
        import termios  # lazily: POSIX only (absent on Windows)

        saved = termios.tcgetattr(stream.fileno()) if stream.isatty() else None
    except (ImportError, OSError, ValueError):
        saved = None
    try:
        yield
    finally:
        if saved is not None:
            with contextlib.suppress(OSError):
                termios.tcsetattr(stream.fileno(), termios.TCSADRAIN, saved)
