"""Progress of long prompts: the CLI's progress line, the engine's per-request prefill progress and what
/metrics makes of it."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

from deltafin.config import load_config
from deltafin.coordinator.backend import LocalBackend
from deltafin.coordinator.engine import Engine
from deltafin.coordinator.generation import PlainText
from deltafin.coordinator.metrics import render
from deltafin.pipeline import LocalPipeline
from deltafin.progress import Reporter
from deltafin.tokenizer import K3Tokenizer


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, text
    return float(m.group(1))


async def test_prefill_progress_per_chunk_and_in_metrics(tiny_dir: Path) -> None:
    engine = Engine(LocalBackend(LocalPipeline.load(tiny_dir, 1, "cpu", "fp32")), K3Tokenizer.load(tiny_dir),
                    load_config(tiny_dir), "tiny")
    engine._prefill_chunk = lambda: 5  # type: ignore[method-assign]
    seen: list[tuple[int, int, float, float]] = []

    def progress(done: int, total: int) -> None:
        text = render(engine, [], {})
        seen.append((done, total, _metric(text, "deltafin_prefill_tokens_done"),
                     _metric(text, "deltafin_prefill_tokens_left")))

    prompt = list(range(100, 123))  # 23 tokens: chunks of 5, 5, 5, 5, 3
    events = [e async for e in engine.run(prompt, PlainText(engine.tokenizer), max_tokens=2, progress=progress)]
    assert len(events) == 3
    assert [(d, t) for d, t, _, _ in seen] == [(0, 23), (5, 23), (10, 23), (15, 23), (20, 23), (23, 23)]
    # while prefilling, /metrics shows the request's tokens done and left; once done, it is gone
    assert [(d, left) for _, _, d, left in seen[:-1]] == [(0, 23), (5, 18), (10, 13), (15, 8), (20, 3)]
    assert seen[-1][2:] == (0.0, 0.0) and not engine.prefilling
    assert _metric(render(engine, [], {}), "deltafin_prefill_requests") == 0
    await engine.close()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_reporter_counts_only_what_is_left_and_closes(caplog) -> None:
    stream = _Terminal()  # on a terminal the line is redrawn, and closed with the final count
    report = Reporter("prefill", "tokens", stream=stream)
    with caplog.at_level(logging.INFO, logger="deltafin.progress"):
        report(4000, 10000)  # 4000 resumed from the prefix cache
        report(6000, 10000)
        assert report.bar is not None and report.bar.total == 6000 and report.bar.done == 2000
        report(10000, 10000)
    assert report.bar is None
    assert "6000 tokens to go (4000 already in the cache)" in caplog.text
    assert stream.getvalue().endswith("\n") and "100.0% 6000 tokens / 6000 tokens" in stream.getvalue()
    quiet = Reporter("prefill", "tokens", stream=io.StringIO())
    quiet(10, 10)  # nothing to prefill (all resumed): no line at all
    assert quiet.bar is None
