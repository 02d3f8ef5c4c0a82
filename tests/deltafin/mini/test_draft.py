"""k3-mini's draft head: the trainer on a tiny problem (the loss falls; the same seed, the same head), the
acceptance count against a direct simulation, and the shipped head on answers it never trained on."""

from __future__ import annotations

import pytest
import torch

import deltafin
from deltafin.mini import draft
from deltafin.mini.draft_data import Answered, Features, target_features
from deltafin.models import eagle
from deltafin.paths import bundled_model
from deltafin.text.drafting import Calibration
from deltafin.weights.draft_head import load_eagle

TINY = draft.DraftTrainConfig(aux_layers=(0, 1), draft_vocab=24, intermediate_size=32, steps=30, batch=3,
                              unroll=2, lr=1e-2, warmup=5, log_every=29)


def tiny_data(seed: int = 0) -> Features:
    """Six sequences whose next token is a fixed function of the features (learnable), answers from row 4."""
    g = torch.Generator().manual_seed(seed)
    lengths = [12, 9, 15, 10, 11, 13]
    ids = torch.randint(0, 32, (sum(lengths),), generator=g)
    feats = torch.randn(sum(lengths), 16, generator=g)
    labels = (feats[:, 0] * 5).long().clamp(-8, 7) + 8
    offsets = tuple(int(x) for x in torch.tensor([0, *lengths]).cumsum(0))
    return Features(ids, feats.to(torch.bfloat16), labels, offsets, (4,) * len(lengths))


def tiny_head(seed: int) -> tuple[eagle.EagleConfig, eagle.EagleWeights, torch.Tensor]:
    cfg = draft.head_config(TINY, 8, 2, 32, 1e-5)
    g = torch.Generator().manual_seed(99)
    to_target = torch.arange(24)
    w = draft.init_weights(cfg, torch.randn(32, 8, generator=g), torch.randn(32, 8, generator=g), torch.ones(8),
                           to_target, seed)
    to_draft = torch.full((32,), -1, dtype=torch.long)
    to_draft[to_target] = to_target
    return cfg, w, to_draft


def test_training_lowers_the_loss_and_is_deterministic_with_the_seed():
    data = tiny_data()
    cfg, w, to_draft = tiny_head(0)
    trained, history = draft.train_head(cfg, w, data, to_draft, TINY)
    again, history2 = draft.train_head(cfg, *tiny_head(0)[1:2], data, to_draft, TINY)
    assert [{**r, 'seconds': 0} for r in history] == [{**r, 'seconds': 0} for r in history2]
    assert all(torch.equal(getattr(trained, n), getattr(again, n)) for n in draft.TRAINED)
    assert history[-1]["loss"] < 0.6 * history[0]["loss"]
    assert torch.equal(trained.embed, w.embed)  # the target's embedding stays frozen


def test_chains_count_what_propose_would_have_drafted():
    """chains() (every anchor at once) == propose() on a cache committed up to each anchor, compared with the
    target's tokens, and so are the confidences calibration() counts; speculate() then counts passes as a
    decoding loop would."""
    data = tiny_data(1)
    cfg, w, _ = tiny_head(1)
    head = eagle.EagleHead(cfg, w)
    counted = draft.chains(head, data, 3)
    judged = list(draft.drafted(head, data, 3))
    by_hand = Calibration()
    for i in range(len(data.starts)):
        o, s, e = data.offsets[i], data.starts[i], data.offsets[i + 1]
        for anchor in range(s - 1, e - o - 1):
            cache = head.new_cache()
            head.commit(cache, data.features[o:o + anchor + 1].float(), data.ids[o + 1:o + anchor + 2])
            truth = data.labels[o + anchor + 1:e - 1].tolist()
            chain = head.propose(cache, 3)
            right = 0
            for d, t in zip(chain.tokens, truth, strict=False):
                if d != t:
                    break
                right += 1
            assert counted[i][anchor - s + 1] == right == judged[i][0][anchor - s + 1]
            # the head's probability for each draft the answer can judge (those before its end), as propose gives it
            sure = judged[i][1][anchor - s + 1]
            assert sure == pytest.approx(chain.confidence[:len(truth)], abs=1e-5)
            if truth:
                by_hand.update(chain.confidence[:len(truth)], right)
    measured = draft.calibration(head, data, 3).describe()
    assert sum(s["judged"] for s in measured) > 0
    for got, want in zip(measured, by_hand.describe(), strict=True):  # a confidence within 1e-5 of a slice's edge
        assert got == pytest.approx(want, abs=1e-3)                   # would move a draft: none does here
    assert draft.speculate([[0, 0, 0, 0, 0]], 2) == {"passes": 4, "tokens": 4, "tokens_per_pass": 1.0,
                                                     "forwards_per_token": 1.0}
    run = draft.speculate([[3, 9, 9, 0, 0, 0, 0]], 2)  # 3 tokens (2 drafts capped by k), then 1 a pass
    assert (run["passes"], run["tokens"]) == (4, 6)


def test_the_shipped_head_drafts_k3_minis_answers_to_prompts_it_never_saw():
    """Two bench prompts (excluded from the head's training), answered greedily by the runtime: the shipped
    head's chains of 4 give more than 2.5 tokens a verify pass (4.09 measured on the 2-core VM; the margin is for
    another CPU's rounding moving a greedy answer; a head that knows nothing drafts nothing right: 1 a pass)."""
    head = load_eagle(bundled_model() / "draft", bundled_model(), "cpu")
    with deltafin.load("k3-mini", "cpu", progress=False) as model:
        replies = [model.chat([{"role": "user", "content": q}], max_tokens=48, temperature=0.0)
                   for q in ("What does `json.dumps` do?", "Show me the source of `heapq.heappush`.")]
    answered = [Answered(tuple(r.prompt_ids + r.token_ids), len(r.prompt_ids)) for r in replies]
    data = target_features(bundled_model(), answered, head.config.aux_layers)
    result = draft.speculate(draft.chains(head, data, 4), 4)
    assert result["tokens_per_pass"] > 2.5, result
