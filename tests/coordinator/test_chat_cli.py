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
