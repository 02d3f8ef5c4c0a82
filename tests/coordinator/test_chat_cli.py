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
