"""`deltafin chat`: turns, /think and unknown commands over the command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_chat_command(tiny_dir: Path) -> None:
    script = "hello\n/think low\n/bogus\nand again\n/exit\n"
    done = subprocess.run([sys.executable, "-m", "deltafin", "chat", "--model", str(tiny_dir), "--local",
                           "--temperature", "0", "--max-tokens", "5"], input=script, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("you> ") == 5
    assert done.stderr.count("[5 tokens") == 2
    assert "[thinking low]" in done.stderr and "unknown command '/bogus'" in done.stderr
    # piped: each channel marked (no dimming to tell them apart); once loaded, no info log inside the chat
    assert done.stdout.count("[reasoning] ") + done.stdout.count("[answer] ") >= 2
    after_load = done.stderr[done.stderr.index("chatting with"):]
    assert " I deltafin" not in after_load, after_load


def test_a_message_over_the_context_keeps_the_conversation(tiny_dir: Path) -> None:
    """A message longer than the context is refused with the limit and what to do; the chat goes on with the
    conversation it had (before: exit status 1, the conversation lost, a hint naming a flag chat did not take)."""
    script = "hello\n" + "word " * 600 + "\nand again\n/exit\n"
    done = subprocess.run([sys.executable, "-m", "deltafin", "chat", "--model", str(tiny_dir), "--local",
                           "--temperature", "0", "--max-tokens", "5", "--max-context", "400"], input=script,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("you> ") == 4 and done.stderr.count("[5 tokens") == 2
    assert "more than the context limit of 400 tokens (what the memory plan holds; --max-context N plans for " \
           "more); the conversation so far is kept: send a shorter message, or /reset to start anew" in done.stderr


def _in_a_terminal(argv: list[str], keys: list[bytes], prompts: tuple[bytes, ...], timeout: float = 240.0) -> bytes:
    """Run `argv` on a pseudo-terminal (its stdin, stdout and stderr), type `keys` one after another, each once the
    output shows one more of `prompts`, and return everything it wrote."""
    import os
    import pty
    import select
    import time

    pid, fd = pty.fork()
    if pid == 0:  # the child: the command on the terminal
        os.execv(argv[0], argv)
    out, deadline, sent = b"", time.monotonic() + timeout, 0
    try:
        while time.monotonic() < deadline:
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # the child is gone
                    break
                if not chunk:
                    break
                out += chunk
            if sent < len(keys) and sum(out.count(p) for p in prompts) > sent:
                for i in range(0, len(keys[sent]), 512):  # as a paste arrives: in pieces
                    os.write(fd, keys[sent][i:i + 512])
                sent += 1
    finally:
        os.waitpid(pid, 0) if sent == len(keys) else os.kill(pid, 9)
        os.close(fd)
    return out


def test_a_terminal_takes_a_paste_longer_than_its_line_buffer(tiny_dir: Path) -> None:
    """In a terminal, a 10,000-character message (over Linux's 4,096-byte line buffer, which cut it before) reaches
    the chat whole: here, whole enough to be over a 2,000-token context, which the chat says and goes on from; then
    a message joined over two lines by a trailing backslash."""
    long = b"word " * 2000
    out = _in_a_terminal([sys.executable, "-m", "deltafin", "chat", "--model", str(tiny_dir), "--local",
                          "--temperature", "0", "--max-tokens", "4", "--max-context", "2000"],
                         [long + b"\r", b"first line \\\r", b"second line\r", b"/exit\r"], prompts=(b"you> ", b"...> "))
    text = out.decode(errors="replace")
    assert "the prompt has" in text and "more than the context limit of 2000 tokens" in text, text[-3000:]
    assert "...> " in text and text.count("[4 tokens") == 1, text[-3000:]
