"""Progress of long prompts: the engine's per-request prefill progress and what /metrics makes of it (the CLI's
line: tests/coordinator/engine/test_report.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deltafin.checkpoint.config import load_config
from deltafin.coordinator.cluster.backend import LocalBackend
from deltafin.coordinator.engine.engine import Engine
from deltafin.coordinator.engine.events import PrefillProgress
from deltafin.coordinator.engine.generation import Generation
from deltafin.coordinator.engine.token_loop import PlainText
from deltafin.coordinator.http.metrics import render
from deltafin.plan.timing.predict import forward_read_bytes
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.text.tokenizer import K3Tokenizer


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, text
    return float(m.group(1))


async def test_prefill_progress_per_chunk_within_forwards_and_in_metrics(tiny_dir: Path) -> None:
    """A prompt's progress after every chunk and after every layer of each forward, in tokens and in expected
    expert bytes (what a forward of that many tokens reads); /metrics shows the request while it prefills."""
    engine = Engine(LocalBackend(LocalPipeline.load(tiny_dir, 1, "cpu", "fp32")), K3Tokenizer.load(tiny_dir),
                    load_config(tiny_dir), "tiny")
    engine._prefill_chunk = lambda: 5  # type: ignore[method-assign]
    seen: list[tuple[PrefillProgress, float, float, float]] = []

    def progress(p: PrefillProgress) -> None:
        text = render(engine, [], {})
        seen.append((p, _metric(text, "deltafin_prefill_tokens_done"), _metric(text, "deltafin_prefill_tokens_left"),
                     _metric(text, "deltafin_prefill_bytes_left")))

    prompt = list(range(100, 123))  # 23 tokens: the fewest chunks of at most 5, of equal length: 5, 5, 5, 4, 4
    events = [e async for e in engine.run(prompt, PlainText(engine.tokenizer), Generation(2), progress=progress)]
    assert len(events) == 3
    cfg = engine.cfg
    total = 3 * forward_read_bytes(cfg, 5) + 2 * forward_read_bytes(cfg, 4)
    tokens = [p.tokens_done for p, *_ in seen]
    assert tokens == sorted(tokens) and tokens[0] == 0 and tokens[-1] == 23
    assert {0, 5, 10, 15, 19, 23} <= set(tokens)  # every chunk's end
    assert any(5 < t < 10 for t in tokens)  # and within the second forward, as its layers go
    assert all(p.tokens_total == 23 and p.bytes_total == pytest.approx(total) for p, *_ in seen)
    assert seen[-1][0].bytes_done == pytest.approx(total)
    at_ten = next(p for p, *_ in seen if p.tokens_done == 10)
    assert at_ten.bytes_done == pytest.approx(2 * forward_read_bytes(cfg, 5))
    # while prefilling, /metrics shows the request's tokens done and left and its bytes left; once done, gone
    for p, done, left, bytes_left in seen:
        if p.finished:  # the prompt is in: /metrics no longer lists it
            assert (done, left, bytes_left) == (0.0, 0.0, 0.0)
            continue
        assert (done, left) == (round(p.tokens_done), round(23 - p.tokens_done))
        assert bytes_left == pytest.approx(total - p.bytes_done)
    assert not engine.prefilling
    assert _metric(render(engine, [], {}), "deltafin_prefill_requests") == 0
    await engine.close()
