"""Stages keep sequence state after a request and resume new sessions from it exactly, within their budget
(least recently used first); a missing or mismatched prefix is a clear error."""

from __future__ import annotations

import pytest
import torch

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import open_checkpoint
from deltafin.errors import InvalidInput, PrefixNotFound
from deltafin.models.cache import mla_capacity
from deltafin.plan.sizing import SizingOptions, kda_state_bytes, mla_row_bytes
from deltafin.runtime.stage import SeqInput, Stage
from deltafin.runtime.stage_options import StageOptions

CPU = torch.device("cpu")


PROMPT = [(7 * i) % 900 + 5 for i in range(300)]


@pytest.fixture(scope="module")
def ckpt(tiny_dir):
    return open_checkpoint(tiny_dir, load_config(tiny_dir))


def _ids(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs)


# ---- the stage's store ------------------------------------------------------------------------------------


def test_a_resumed_session_equals_one_that_went_on(ckpt):
    """Keep a session at 300 tokens (on release: moved, not copied); a new session resumed from it and fed
    the same next chunk gives the logits the original session gives for it, bit for bit (same tensors, same
    computation). And the kept state is the state at 300 tokens, whatever came after."""
    stage = Stage(ckpt, 0, 6, device=CPU)
    stage.forward([SeqInput("a", 0, ids=_ids(PROMPT))])
    stage.release("a", keep_as="p300")
    nxt = _ids([11, 12, 13, 14])
    resumed = stage.forward([SeqInput("b", 300, ids=nxt, resume_from="p300")])[0].logits
    stage.forward([SeqInput("ref", 0, ids=_ids(PROMPT))])
    want = stage.forward([SeqInput("ref", 300, ids=nxt)])[0].logits
    assert torch.equal(resumed, want)
    again = stage.forward([SeqInput("c", 300, ids=nxt, resume_from="p300")])[0].logits  # b went on; p300 did not
    assert torch.equal(again, want)
    assert stage.prefixes.stats.resumed == 2 and stage.sessions["b"].length == 304


def test_a_snapshot_of_a_live_session_is_not_disturbed_by_it(ckpt):
    """save_as shares the live session's tensors: the session then appends 200 more tokens into the same MLA
    buffer and replaces its KDA states, and a session resumed from the snapshot still sees exactly the
    state at the snapshot (equal to a fresh session fed the same chunks)."""
    stage = Stage(ckpt, 0, 6, device=CPU)
    stage.forward([SeqInput("live", 0, ids=_ids(PROMPT[:100]), save_as="p100")])
    for pos in range(100, 300, 50):
        stage.forward([SeqInput("live", pos, ids=_ids(PROMPT[pos:pos + 50]))])
    other = _ids([900, 901, 902])
    got = stage.forward([SeqInput("r", 100, ids=other, resume_from="p100")])[0].logits
    stage.forward([SeqInput("fresh", 0, ids=_ids(PROMPT[:100]))])
    want = stage.forward([SeqInput("fresh", 100, ids=other)])[0].logits
    assert torch.equal(got, want)


def test_missing_and_mismatched_prefixes_are_clear_errors(ckpt):
    stage = Stage(ckpt, 0, 6, device=CPU)
    with pytest.raises(PrefixNotFound, match="prefix 'nope' is not on stage"):
        stage.forward([SeqInput("x", 5, ids=_ids([1]), resume_from="nope")])
    stage.forward([SeqInput("a", 0, ids=_ids(PROMPT[:10]), save_as="p10")])
    with pytest.raises(InvalidInput, match="holds 10 tokens, not 9"):
        stage.forward([SeqInput("y", 9, ids=_ids([1]), resume_from="p10")])
    assert "x" not in stage.sessions and "y" not in stage.sessions
    assert stage.release("p10") and "p10" not in stage.prefixes.entries  # an id naming a prefix drops it


def test_the_store_keeps_within_its_budget_least_recently_used_first(ckpt):
    """The budget is three kept states of 40 tokens; a fourth evicts the least recently used one, a state
    larger than the whole budget is refused, and the bytes never pass the budget."""
    cfg = ckpt.config
    n_kda = sum(k.name == "KDA" for k in cfg.layer_kinds)
    n_mla = cfg.num_layers - n_kda
    one = n_kda * kda_state_bytes(cfg) + n_mla * mla_capacity(40) * mla_row_bytes(cfg, 4)
    stage = Stage(ckpt, 0, 6, device=CPU, options=StageOptions(sizing=SizingOptions(prefix_cache_bytes=3 * one)))
    for i, sid in enumerate("abcd"):
        stage.forward([SeqInput(sid, 0, ids=_ids(PROMPT[i:i + 40]))])
        if sid == "d":
            stage.prefixes.get("kept-a")  # a is now more recent than b
        stage.release(sid, keep_as=f"kept-{sid}")
        assert stage.prefixes.nbytes <= 3 * one
    assert list(stage.prefixes.entries) == ["kept-c", "kept-a", "kept-d"]
    assert stage.prefixes.nbytes == 3 * one and stage.prefixes.stats.evicted == 1
    small = Stage(ckpt, 0, 6, device=CPU, options=StageOptions(sizing=SizingOptions(prefix_cache_bytes=one)))
    small.forward([SeqInput("long", 0, ids=_ids(PROMPT))])  # 300 tokens: two MLA blocks, the budget holds one
    small.release("long", keep_as="kept-long")
    assert not small.prefixes.entries and small.prefixes.stats.refused == 1 and "long" not in small.sessions
