"""`deltafin demo`: the bundled k3-mini by default; with a random preset, writes its synthetic checkpoint once
into the cache, runs a one-worker cluster, reuses the checkpoint on the next run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def test_demo_runs_and_reuses_its_checkpoint(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "deltafin", "demo", "--preset", "tiny", "--cache-dir", str(tmp_path),
           "--max-tokens", "6"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "RANDOM WEIGHTS" in first.stderr and "writing a synthetic K3 checkpoint" in first.stderr
    assert "deltafin-worker on 127.0.0.1:" in first.stderr and "[6 tokens" in first.stderr
    assert first.stdout.startswith("user: ")
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "using the cached checkpoint" in again.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["synthetic-k3-tiny-seed0"]


def test_demo_defaults_to_the_trained_k3_mini_and_writes_nothing(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "deltafin", "demo", "--cache-dir", str(tmp_path), "--max-tokens", "40"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "k3-mini, trained on Python's documentation" in run.stderr and "RANDOM" not in run.stderr
    assert re.search(r"\[\d+ tokens, [\d.]+ tok/s", run.stderr)
    assert run.stdout.startswith("user: What does `json.dumps` do?\nassistant (thinking): The question is about `")
    assert "\nassistant: `" in run.stdout  # the answer channel, as the training taught it
    assert list(tmp_path.iterdir()) == []  # the bundled model needs no synthesis


def test_the_demo_shows_its_reply_and_keeps_the_plan_behind_v(tmp_path: Path) -> None:
    """Before its reply the demo says what runs in a line each, the plan included; `-v` shows the whole plan and the
    coordinator's log; `-q` leaves the reply and its stats line."""
    cmd = [sys.executable, "-m", "deltafin", "demo", "--cache-dir", str(tmp_path), "--max-tokens", "4"]
    plain = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    before_reply = plain.stderr[:plain.stderr.index("[4 tokens")]
    assert len(before_reply.splitlines()) == 3, before_reply  # the model, the worker, the plan
    assert re.search(r"^plan: demo-worker layers 0-7; experts local; a token .* predicted \(-v: the whole plan\)$",
                     before_reply, re.M)
    verbose = subprocess.run([*cmd, "-v"], capture_output=True, text=True, timeout=300)
    assert "GB/token" in verbose.stderr and "compute (measured by each worker)" in verbose.stderr
    assert " D deltafin" in verbose.stderr
    quiet = subprocess.run([*cmd, "-q"], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and "plan:" not in quiet.stderr and "[4 tokens" in quiet.stderr
