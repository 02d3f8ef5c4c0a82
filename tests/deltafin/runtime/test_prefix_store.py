"""Stages keep sequence state after a request and resume new sessions from it exactly, within their budget
(least recently used first); a missing or mismatched prefix is a clear error."""

from __future__ import annotations

import pytest
import torch

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import open_checkpoint
from deltafin.errors import InvalidInput, PrefixNotFound
from deltafin.models.pieces import mla_capacity
from deltafin.plan.memory.sizing import SizingInput
from deltafin.plan.memory.stage_parts import kda_state_bytes, mla_row_bytes
from deltafin.runtime.stage import Stage
from deltafin.runtime.stage_io import SeqInput
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
    """save_at shares the live session's tensors: the session then appends 200 more tokens into the same MLA
    buffer and replaces its KDA states, and a session resumed from the snapshot still sees exactly the
    state at the snapshot (equal to a fresh session fed the same chunks)."""
    stage = Stage(ckpt, 0, 6, device=CPU)
    stage.forward([SeqInput("live", 0, ids=_ids(PROMPT[:100]), save_at=((100, "p100"),))])
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
    stage.forward([SeqInput("a", 0, ids=_ids(PROMPT[:10]), save_at=((10, "p10"),))])
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
    stage = Stage(ckpt, 0, 6, device=CPU, options=StageOptions(sizing=SizingInput(prefix_cache_bytes=3 * one)))
    for i, sid in enumerate("abcd"):
        stage.forward([SeqInput(sid, 0, ids=_ids(PROMPT[i:i + 40]))])
        if sid == "d":
            stage.prefixes.get("kept-a")  # a is now more recent than b
        stage.release(sid, keep_as=f"kept-{sid}")
        assert stage.prefixes.nbytes <= 3 * one
    assert list(stage.prefixes.entries) == ["kept-c", "kept-a", "kept-d"]
    assert stage.prefixes.nbytes == 3 * one and stage.prefixes.stats.evicted == 1
    small = Stage(ckpt, 0, 6, device=CPU, options=StageOptions(sizing=SizingInput(prefix_cache_bytes=one)))
    small.forward([SeqInput("long", 0, ids=_ids(PROMPT))])  # 300 tokens: two MLA blocks, the budget holds one
    small.release("long", keep_as="kept-long")
    assert not small.prefixes.entries and small.prefixes.stats.refused == 1 and "long" not in small.sessions


@pytest.mark.parametrize("model,stages", [("tiny", 1), ("tiny", 3), ("small", 1), ("small", 3)])
def test_resuming_at_every_kind_of_keep_point_gives_a_full_prefills_logits(model, stages, request):
    """A 200-token prompt fed in forwards of 64, 64 and 72 tokens keeps its state at a message's end inside the
    first forward (37), at a forward's end (64), at a grid point inside the second (100) and at the prompt's end
    (200, with its logits on the last stage). A new session resumed at each point and fed the rest of the
    prompt and 5 more tokens gives the logits a full prefill gives there: relative L2 over those positions within
    1e-5, per position within 1e-4, the same top-1; the kept logits are the prefill's last row. (fp32: a prompt
    fed in two forwards split at the same point, nothing kept, is as far from the one-forward prefill: measured
    on tiny up to 6.6e-5 at one position, 1e-6 typical; the random router amplifies rounding.)"""
    from deltafin.runtime.pipeline import LocalPipeline

    pipe = LocalPipeline.load(request.getfixturevalue(f"{model}_dir"), stages, device="cpu")
    text = [(13 * i) % 700 + 3 for i in range(205)]
    points = {37: "message", 64: "forward end", 100: "grid", 200: "prompt end"}
    full = pipe.forward([SeqInput("full", 0, ids=_ids(text))], all_logits=True)[0].logits
    pos = 0
    for end in (64, 128, 200):
        keep = tuple((p, f"p{p}") for p in points if pos < p <= end)
        pipe.forward([SeqInput("kept", pos, ids=_ids(text[pos:end]), save_at=keep)])
        pos = end
    kept_logits = pipe.stages[-1].held_prefixes(["p200"], "p200").logits
    assert float((kept_logits - full[199]).norm() / full[199].norm()) < 1e-5
    for p in points:
        got = pipe.forward([SeqInput(f"r{p}", p, ids=_ids(text[p:]), resume_from=f"p{p}")], all_logits=True)[0].logits
        want = full[p:]
        rel = (got - want).norm(dim=1) / want.norm(dim=1)
        assert float((got - want).norm() / want.norm()) < 1e-5 and rel.max() < 1e-4, (points[p], float(rel.max()))
        assert torch.equal(got.argmax(1), want.argmax(1)), points[p]
    for s in pipe.stages:  # every stage holds every point, at its length
        assert s.held_prefixes([f"p{p}" for p in points]).lengths == {f"p{p}": p for p in points}
    pipe.close()
