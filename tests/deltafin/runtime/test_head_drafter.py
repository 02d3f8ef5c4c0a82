"""The learned drafter's cache across requests (runtime/head_drafter.py): a request that resumes a kept prefix
gets no features for it, so it starts from the rows a finished request left for the same text, cut back to the
rows both texts share, and drafts what a drafter that saw every row would."""

from __future__ import annotations

import pytest
import torch

from deltafin.checkpoint.config import load_config
from deltafin.runtime.features import FeatureAsk
from deltafin.runtime.head_drafter import DraftMemory, HeadDrafter, Kept, open_head
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from tests.support.draft_heads import write_random_head

TEXT = [5, 17, 3, 99, 42, 7, 250, 8, 61, 12, 400, 33]


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory):
    head = open_head(write_random_head(tmp_path_factory.mktemp("h") / "draft", tiny_dir), tiny_dir,
                     load_config(tiny_dir), "cpu")
    pipe = LocalPipeline.load(tiny_dir, 1, device="cpu")
    layers = tuple(head.config.aux_layers)
    # every position's features, the text fed at once
    feats = pipe.forward([SeqInput("all", 0, ids=torch.tensor(TEXT), features=FeatureAsk(layers, 0))])[0].features
    yield head, feats
    pipe.close()


def _rows(feats, a, b):
    return {k: v[a:b] for k, v in feats.items()}


def test_a_request_resuming_a_kept_text_drafts_as_if_it_had_seen_it(setup):
    head, feats = setup
    memory = DraftMemory()
    first = HeadDrafter(head, memory)
    first.observe(TEXT, 0, _rows(feats, 0, 8))  # a prompt of 8 tokens, then its first token TEXT[8]
    want = first.propose(TEXT[:9], 4).tokens
    first.done(TEXT[:9])
    again = HeadDrafter(head, memory)  # the same prompt resumed whole: no forward, no features
    assert again.propose(TEXT[:9], 4).tokens == want
    assert again.first == 0 and again.next == 8
    fresh = HeadDrafter(head, DraftMemory())
    assert fresh.propose(TEXT[:9], 4).tokens == []  # nothing kept: it waits for a forward's rows


def test_only_the_rows_both_texts_share_are_taken(setup):
    head, feats = setup
    memory = DraftMemory()
    a = HeadDrafter(head, memory)
    a.observe(TEXT, 0, _rows(feats, 0, 10))
    a.done(TEXT[:11])
    other = [*TEXT[:6], 1000, *TEXT[7:]]  # differs at position 6: rows 0..4 hold (row 5 is followed by 1000)
    kept = memory.find(other)
    assert kept is not None and kept.first == 0 and kept.cache.length == 5
    # a drafter that then gets the rows from 5 on equals one that saw them all from the start
    b = HeadDrafter(head, memory)
    b.observe(other, 5, _rows(feats, 5, 6))
    whole = HeadDrafter(head, None)
    whole.observe(other, 0, _rows(feats, 0, 6))
    assert b.next == whole.next == 6
    assert torch.allclose(b.cache.hiddens, whole.cache.hiddens, atol=1e-6)
    assert b.propose(other[:7], 3).tokens == whole.propose(other[:7], 3).tokens
    # rows a forward brings that the kept cache holds already are skipped, not committed twice
    c = HeadDrafter(head, memory)
    c.observe(TEXT, 3, _rows(feats, 3, 10))
    assert c.next == 10 and c.cache.length == 10


def test_the_memory_forgets_the_least_recently_used_beyond_its_budget(setup):
    head, feats = setup
    d = HeadDrafter(head, None)
    d.observe(TEXT, 0, _rows(feats, 0, 4))
    one = Kept(tuple(TEXT[:5]), 0, d.cache)
    memory = DraftMemory(budget_bytes=2 * one.nbytes + 1)
    for i in range(3):
        memory.keep(Kept((i, *TEXT[1:5]), 0, d.cache))
    assert [k[0] for k in memory.entries] == [1, 2] and memory.nbytes == 2 * one.nbytes
    assert memory.find([0, *TEXT[1:5]]) is None  # forgotten
