"""k3-mini's held-out perplexity, measured through the runtime on the shipped (MXFP4) files: far below a
model of the same architecture with random weights, and below the vocabulary size (what knowing nothing
scores)."""

from __future__ import annotations

import shutil
from pathlib import Path

from deltafin.mini.corpus import read_jsonl
from deltafin.mini.evaluate import perplexity
from deltafin.mini.synth import synthesize
from deltafin.paths import bundled_model

# 60 conversations about modules the training never saw (corpus.held_out: ftplib, reprlib, wave, ...)
HELDOUT = Path(__file__).resolve().parents[2] / "data" / "k3_mini_heldout.jsonl"


def test_heldout_perplexity_is_far_below_random_weights(tmp_path):
    convs = read_jsonl(HELDOUT)
    trained = perplexity(bundled_model(), convs)
    assert trained["conversations"] == 60 and trained["tokens"] > 10_000
    # measured 14.3 on all 428 held-out conversations (README); 30 leaves room for this sample's mix
    assert trained["perplexity"] < 30, trained
    random = synthesize("mini", tmp_path / "random", seed=0, show_progress=False)
    shutil.copy(bundled_model() / "tiktoken.model", random / "tiktoken.model")  # the same tokens
    untrained = perplexity(random, convs[:10])
    assert untrained["perplexity"] > 0.5 * untrained["vocab_size"]  # random weights know nothing (~e^9.4)
    assert untrained["perplexity"] > 100 * trained["perplexity"]
