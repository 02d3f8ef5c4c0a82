"""`speculative="draft"`: a learned draft head's proposals verified by the model, through the serving engine.
A head with random weights drafts mostly wrong tokens, so every rejection path runs: the output must still be
the plain output, token for token, however the layers are split and however many requests run at once."""

from __future__ import annotations

import json
import threading

import pytest

import deltafin
from deltafin.errors import DeltafinError
from deltafin.text.drafting import Calibration
from tests.support.draft_heads import write_random_head

MESSAGES = [[{"role": "user", "content": "What does `json.dumps` do?"}],
            [{"role": "user", "content": "Show me the source of `textwrap.dedent`."}]]


@pytest.fixture(scope="module")
def head(tiny_dir, tmp_path_factory):
    return write_random_head(tmp_path_factory.mktemp("head") / "draft", tiny_dir)


@pytest.fixture(scope="module")
def plain(tiny_dir):
    with deltafin.load(tiny_dir, "cpu", progress=False) as m:
        yield [m.chat(msgs, max_tokens=24, temperature=0.0).token_ids for msgs in MESSAGES]


@pytest.mark.parametrize("stages", [1, 2])
def test_drafted_answers_are_the_plain_ones(tiny_dir, head, plain, stages):
    with deltafin.load(tiny_dir, "cpu", progress=False, speculative="draft", draft_model=str(head),
                       local_stages=stages) as m:
        got = [m.chat(msgs, max_tokens=24, temperature=0.0).token_ids for msgs in MESSAGES]
        c = m.engine.counters
        assert got == plain
        assert c.draft_tokens > 0  # the head did propose (the cost model then drafts less as they miss)
        assert c.forwards >= sum(len(t) for t in got) - len(got) - c.accepted_tokens
        assert len(m.engine.draft_memory.entries) == 2  # each answer's draft cache, kept for its next turn
        # the drafts' fates, by the head's confidence: one calibration for the engine, every judged draft counted
        # (each pass judges its drafts up to the first rejection: the accepted ones and at most one more)
        judged = sum(b["judged"] for b in m.engine.calibration.describe())
        assert c.accepted_tokens < judged <= c.accepted_tokens + c.forwards


def test_concurrent_requests_keep_their_own_draft_state(tiny_dir, head, plain):
    with deltafin.load(tiny_dir, "cpu", progress=False, speculative="draft", draft_model=str(head)) as m:
        got: dict[int, list[int]] = {}

        def ask(i: int) -> None:
            got[i] = m.chat(MESSAGES[i % 2], max_tokens=24, temperature=0.0).token_ids

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [got[i] for i in range(4)] == [plain[0], plain[1], plain[0], plain[1]]


def test_a_request_may_ask_for_the_head(tiny_dir, head, plain):
    with deltafin.load(tiny_dir, "cpu", progress=False, draft_model=str(head)) as m:
        assert m.chat(MESSAGES[0], max_tokens=24, temperature=0.0, speculative="draft").token_ids == plain[0]
        assert m.engine.counters.draft_tokens > 0


def test_no_head_or_another_models_head_is_said_at_load(tiny_dir, small_dir, tmp_path):
    with pytest.raises(DeltafinError, match="has no draft/ folder"):
        deltafin.load(tiny_dir, "cpu", progress=False, speculative="draft")
    with pytest.raises(DeltafinError, match="no config.json"):
        deltafin.load(tiny_dir, "cpu", progress=False, speculative="draft", draft_model=str(tmp_path))
    other = write_random_head(tmp_path / "other", small_dir, aux_layers=(1, 2, 3))  # layers tiny has too
    with pytest.raises(DeltafinError, match="another model"):
        deltafin.load(tiny_dir, "cpu", progress=False, speculative="draft", draft_model=str(other))


def test_the_engine_starts_from_the_calibration_a_head_ships(tiny_dir, tmp_path):
    """A head whose config.json carries its recipe's calibration (`deltafin_trained.calibration`): the engine's
    drafting starts from it, not from the slices' middles."""
    path = write_random_head(tmp_path / "draft", tiny_dir)
    measured = Calibration()
    for _ in range(100):
        measured.update([0.4], accepted=1)  # drafts of 0.4 taken every time
    config = json.loads((path / "config.json").read_text())
    config["deltafin_trained"] = {"calibration": measured.describe()}
    (path / "config.json").write_text(json.dumps(config))
    with deltafin.load(tiny_dir, "cpu", progress=False, speculative="draft", draft_model=str(path)) as m:
        assert m.engine.calibration.acceptance(0.4) > 0.95 > Calibration().acceptance(0.4)
