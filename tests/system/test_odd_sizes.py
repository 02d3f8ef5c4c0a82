"""A model whose sizes are no powers of two (synth preset odd: hidden 96, odd head counts, no matrix whose rows are
whole 64-value groups) runs wherever a user runs one: through two worker processes, plainly, with n-gram drafts and
with a draft head, local and wide; a worker asked for q4 holds it in q4's fallback (int8, exactly the in-process
int8 answer); the command line's generate with drafts and bench. Each once stopped at the compute probe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import deltafin
from deltafin.mini.synth import synthesize
from tests.support.cluster import COORDINATOR, workers
from tests.support.draft_heads import write_random_head

MESSAGES = [{"role": "user", "content": "Explain `os.path.join`."}]
TOKENS = 12


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize("odd", tmp_path_factory.mktemp("odd"), show_progress=False)


def _answer(model, **options) -> list[int]:
    return model.chat(MESSAGES, max_tokens=TOKENS, temperature=0.0, **options).token_ids


def test_an_odd_model_through_two_workers_drafts_the_plain_answer(odd, tmp_path):
    with deltafin.load(odd, device="cpu", progress=False) as m:
        plain = _answer(m)
    head = write_random_head(tmp_path / "draft", odd)
    with workers(odd, 2) as procs:
        addresses = [p.address for p in procs]
        for experts in ("local", "wide"):
            with deltafin.connect(odd, addresses, discover=False, progress=False, experts=experts) as m:
                assert _answer(m) == plain
            with deltafin.connect(odd, addresses, discover=False, progress=False, experts=experts,
                                  speculative="ngram") as m:
                assert _answer(m) == plain
            with deltafin.connect(odd, addresses, discover=False, progress=False, experts=experts,
                                  speculative="draft", draft_model=str(head)) as m:
                assert _answer(m) == plain
                assert m.engine.counters.draft_tokens > 0


def test_a_worker_asked_for_q4_holds_the_odd_model_in_its_fallback(odd):
    with deltafin.load(odd, device="cpu", progress=False, spine="int8") as m:
        int8 = _answer(m)
    with workers(odd, 1, "--spine", "q4") as procs, \
            deltafin.connect(odd, [procs[0].address], discover=False, progress=False) as m:
        assert _answer(m) == int8


def test_the_command_line_generates_with_drafts_and_benches_an_odd_model(odd):
    done = subprocess.run([*COORDINATOR, "--model", str(odd), "--local", "-q", "generate", "hello", "--max-tokens",
                           "8", "--speculative", "ngram", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["completion_tokens"] == 8
    bench = subprocess.run([sys.executable, "-m", "deltafin", "bench", "--model", str(odd), "--tokens", "4", "-q"],
                           capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert json.loads(bench.stdout)["tokens"] == 4
