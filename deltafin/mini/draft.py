"""Training k3-mini's EAGLE-3 draft head (models/eagle.py) on the target's own answers (draft_data.py).

The head learns the target's next token (cross entropy on the target's argmax, which is what a greedy verify
pass accepts) from the target's features, with EAGLE-3's training-time test: after the first step, each
position's chain goes on `unroll` more steps, fed the true next token and the head's OWN previous output
hidden, as drafting feeds it. A chain anchored at row t sees the verified rows up to t and its own earlier
steps, at rotary positions t+1, t+2, ... (the positions `propose` gives them); the loss of step j is weighted
0.8^j. The embedding is the target's, frozen; lm_head starts from the target's lm_head rows of the draft
vocabulary (the `draft_vocab` tokens the target answers with most, d2t mapping them back).

`chains` runs the same computation greedily (each step fed the head's own argmax) and says, for every position,
how many drafts in a row the target would accept; `speculate` turns that into the forwards per generated token
of greedy speculative decoding with k drafts a pass, and `calibration` into how often drafts of each confidence
are taken (what the engine starts from: text/drafting.py's `Calibration`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from deltafin.mini.draft_data import Features
from deltafin.models.eagle import (
    EagleConfig,
    EagleHead,
    EagleWeights,
    attend,
    complete,
    inverse_frequencies,
    logits_of,
    project,
)
from deltafin.text.drafting import Calibration

log = logging.getLogger(__name__)

TRAINED = ("fc", "input_norm", "hidden_norm", "q", "k", "v", "o", "post_norm", "gate", "up", "down", "norm",
           "lm_head")


@dataclass(frozen=True)
class DraftTrainConfig:
    prompts: int = 4608  # training prompts answered by the target
    calibration_prompts: int = 256  # other training prompts, the head's calibration measured on their answers
    max_tokens: int = 96  # each answer's length at most
    aux_layers: tuple[int, ...] = (2, 4, 5)
    draft_vocab: int = 4096
    intermediate_size: int = 512
    steps: int = 2000
    batch: int = 16  # sequences a step
    unroll: int = 3  # training-time-test steps after the first
    lr: float = 3e-3
    min_lr: float = 1e-4
    warmup: int = 50
    weight_decay: float = 0.0
    clip: float = 1.0
    seed: int = 0
    log_every: int = 50


def head_config(tc: DraftTrainConfig, target_hidden: int, heads: int, vocab: int, eps: float) -> EagleConfig:
    return EagleConfig(hidden_size=target_hidden, num_attention_heads=heads, num_key_value_heads=heads,
                       head_dim=target_hidden // heads, intermediate_size=tc.intermediate_size, rms_norm_eps=eps,
                       rope_theta=10000.0, vocab_size=vocab, draft_vocab_size=tc.draft_vocab,
                       aux_layers=tuple(tc.aux_layers), target_hidden_size=target_hidden)


def draft_vocabulary(data: Features, size: int, vocab: int) -> torch.Tensor:
    """The `size` target ids the target answers with most (ties by id), ascending: draft id -> target id."""
    counts = torch.bincount(data.labels[_answer_rows(data)], minlength=vocab).float()
    counts -= torch.arange(vocab) * 1e-9  # deterministic ties: the lower id first
    return counts.topk(size).indices.sort().values


def _answer_rows(data: Features) -> torch.Tensor:
    rows = [torch.arange(o + s, e - 1) for o, e, s in zip(data.offsets, data.offsets[1:], data.starts, strict=False)]
    return torch.cat(rows)


def init_weights(cfg: EagleConfig, embed: torch.Tensor, lm_head: torch.Tensor, norm: torch.Tensor,
                 to_target: torch.Tensor, seed: int) -> EagleWeights:
    """A fresh head: random projections (std 1/sqrt(fan_in), the output ones scaled down), unit norms, the
    target's final norm and lm_head rows, its embedding (frozen)."""
    g = torch.Generator().manual_seed(seed)
    h, d = cfg.hidden_size, cfg.head_dim

    def lin(out: int, inp: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) * scale / math.sqrt(inp)

    ones = lambda: torch.ones(h)
    return EagleWeights(fc=lin(h, cfg.feature_size), input_norm=ones(), hidden_norm=ones(),
                        q=lin(cfg.num_attention_heads * d, 2 * h), k=lin(cfg.num_key_value_heads * d, 2 * h),
                        v=lin(cfg.num_key_value_heads * d, 2 * h), o=lin(h, cfg.num_attention_heads * d, 0.5),
                        post_norm=ones(), gate=lin(cfg.intermediate_size, h), up=lin(cfg.intermediate_size, h),
                        down=lin(h, cfg.intermediate_size, 0.5), norm=norm.detach().float().clone(),
                        lm_head=lm_head.detach().float()[to_target].clone(), embed=embed.detach().float(),
                        d2t=to_target - torch.arange(len(to_target)))


# ---- the unrolled forward -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """Sequences padded to T: ids [B, T+unroll+1] (0 past the end), features [B, T, F], labels [B, T+unroll+1]
    (-1 where no draft is scored: the prompt, past the answer), and each row's chain limit."""

    ids: torch.Tensor
    features: torch.Tensor
    labels: torch.Tensor


def make_batch(data: Features, seqs: list[int], to_draft: torch.Tensor, extra: int) -> Batch:
    """Batch of sequences `seqs`; labels are draft ids (-1: not scored, or a token outside the draft vocab)."""
    lengths = [data.offsets[i + 1] - data.offsets[i] for i in seqs]
    t = max(lengths)
    ids = torch.zeros(len(seqs), t + extra, dtype=torch.long)
    labels = torch.full((len(seqs), t + extra), -1, dtype=torch.long)
    feats = torch.zeros(len(seqs), t, data.features.shape[1])
    for b, (i, n) in enumerate(zip(seqs, lengths, strict=True)):
        o, s = data.offsets[i], data.starts[i]
        ids[b, :n] = data.ids[o:o + n]
        feats[b, :n] = data.features[o:o + n].float()
        # the label at position p is the target's token after p; drafts are scored for answer tokens p+1 >= s+1
        labels[b, s:n - 1] = to_draft[data.labels[o + s:o + n - 1]]
    return Batch(ids, feats, labels)


def unrolled(cfg: EagleConfig, w: EagleWeights, batch: Batch, steps: int, greedy: bool,
             rows: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Draft logits [B, T, V] of each of `steps` chain steps: step j at row t predicts the token at t+j+2,
    seeing the verified rows <= t (step 0's keys) and its chain's earlier steps. `greedy`: each step is fed the
    head's own previous draft (propose's chains) instead of the true token (training). `rows`: step j's logits
    only where rows[j] [B, T] is true ([n, V]: training scores the answer's rows alone, and the vocabulary
    projection is most of a step's work)."""
    b, t = batch.features.shape[:2]
    inv = inverse_frequencies(cfg)
    pos = torch.arange(t)
    causal = pos.unsqueeze(1) >= pos  # [T, T]
    diagonal = torch.eye(t, dtype=torch.bool)
    hidden = F.linear(batch.features, w.fc)  # [B, T, H]
    tokens = batch.ids[:, 1:t + 1]  # step 0 at row t is fed x_{t+1}
    keys, values, masks, out = [], [], [], []
    for j in range(steps):
        q, k, v = project(cfg, w, w.embed[tokens], hidden, pos + j, inv)
        keys.append(k)
        values.append(v)
        masks.append(causal if j == 0 else diagonal)
        attn = attend(cfg, q, torch.cat(keys, 1), torch.cat(values, 1), torch.cat(masks, 1))
        hidden = complete(cfg, w, attn, hidden)
        logits = logits_of(cfg, w, hidden if rows is None else hidden[rows[j]])
        out.append(logits)
        if greedy:
            draft = logits.argmax(-1)
            tokens = draft + w.d2t[draft]
        else:
            tokens = batch.ids[:, j + 2:t + j + 2]
    return out


def loss_of(cfg: EagleConfig, w: EagleWeights, batch: Batch, unroll: int) -> tuple[torch.Tensor, list[float]]:
    """Weighted cross entropy over the chain's steps, and each step's accuracy (of its scored rows)."""
    t = batch.features.shape[1]
    total, weights, accuracy = batch.features.new_zeros(()), 0.0, []
    labels = [batch.labels[:, j + 1:t + j + 1] for j in range(unroll + 1)]
    keeps = [lab >= 0 for lab in labels]
    for j, logits in enumerate(unrolled(cfg, w, batch, unroll + 1, greedy=False, rows=keeps)):
        scored = labels[j][keeps[j]]
        total = total + 0.8 ** j * F.cross_entropy(logits, scored)
        weights += 0.8 ** j
        accuracy.append(float((logits.argmax(-1) == scored).float().mean()))
    return total / weights, accuracy


def train_head(cfg: EagleConfig, w: EagleWeights, data: Features, to_draft: torch.Tensor,
               tc: DraftTrainConfig) -> tuple[EagleWeights, list[dict[str, Any]]]:
    """Train `w`'s TRAINED tensors (AdamW, warm-up then cosine) on `data`'s sequences in seeded order."""
    torch.manual_seed(tc.seed)
    params = {n: getattr(w, n).detach().clone().requires_grad_(True) for n in TRAINED}
    opt = torch.optim.AdamW(params.values(), lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
    order = torch.randperm(len(data.starts), generator=torch.Generator().manual_seed(tc.seed))
    history, t0, at = [], time.perf_counter(), 0
    for step in range(tc.steps):
        if at + tc.batch > len(order):
            order, at = torch.randperm(len(order), generator=torch.Generator().manual_seed(tc.seed + step)), 0
        batch = make_batch(data, order[at:at + tc.batch].tolist(), to_draft, tc.unroll + 2)
        at += tc.batch
        for group in opt.param_groups:
            group["lr"] = _lr(tc, step)
        current = EagleWeights(**{**w.__dict__, **params})
        loss, accuracy = loss_of(cfg, current, batch, tc.unroll)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), tc.clip)
        opt.step()
        if step % tc.log_every == 0 or step == tc.steps - 1:
            record = {"step": step, "loss": round(loss.item(), 4), "accuracy": [round(a, 3) for a in accuracy],
                      "seconds": round(time.perf_counter() - t0, 1)}
            history.append(record)
            log.info("draft step %(step)d loss %(loss).4f accuracy %(accuracy)s %(seconds).1fs", record)
    trained = {n: p.detach() for n, p in params.items()}
    return EagleWeights(**{**w.__dict__, **trained}), history


def _lr(tc: DraftTrainConfig, step: int) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    progress = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * progress))


# ---- what the head is worth ---------------------------------------------------------------------------------


def drafted(head: EagleHead, data: Features, k: int) -> Iterator[tuple[list[int], list[list[float]]]]:
    """For every sequence, at each anchor row from the prompt's last on: how many of the head's k greedy drafts
    after it the target accepts in a row (its argmax, teacher-forced), and the head's probability for each of
    those it can judge (the drafts before the answer's end)."""
    to_draft = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    draft_ids = torch.arange(head.config.draft_vocab_size)
    d2t = head.weights.d2t.cpu()
    to_draft[draft_ids + d2t] = draft_ids
    with torch.no_grad():
        for i in range(len(data.starts)):
            batch = make_batch(data, [i], to_draft, k + 2)
            t, s = batch.features.shape[1], data.starts[i]
            targets = data.labels[data.offsets[i]:data.offsets[i + 1]]
            right = torch.zeros(t, dtype=torch.long)
            alive = torch.ones(t, dtype=torch.bool)
            confidence = torch.zeros(t, k)
            for j, logits in enumerate(unrolled(head.config, head.weights, batch, k, greedy=True)):
                probs = logits[0].float().softmax(-1)
                confidence[:, j], draft = probs.max(-1)
                target = torch.full((t,), -1, dtype=torch.long)
                n = max(0, t - j - 2)  # rows whose step j predicts an answer token (position t+j+1 <= T-2)
                target[:n] = targets[j + 1:j + 1 + n]
                alive &= (draft + d2t[draft]) == target
                right += alive.long()
            yield (right[s - 1:t - 1].tolist(),
                   [confidence[r, :max(0, min(k, t - 2 - r))].tolist() for r in range(s - 1, t - 1)])


def chains(head: EagleHead, data: Features, k: int) -> list[list[int]]:
    """For every sequence, at each anchor row from the prompt's last on: how many of the head's k greedy
    drafts after it the target accepts in a row (its argmax, teacher-forced)."""
    return [right for right, _ in drafted(head, data, k)]


def calibration(head: EagleHead, data: Features, k: int) -> Calibration:
    """How often the head's drafts are taken by the confidence it gives them (text/drafting.py's slices), its
    greedy chain of k judged at every position as a verify pass judges it: up to the first rejection."""
    measured = Calibration()
    for right, confidence in drafted(head, data, k):
        for taken, drafts in zip(right, confidence, strict=True):
            if drafts:
                measured.update(drafts, taken)
    return measured


def speculate(chain: list[list[int]], k: int) -> dict[str, float]:
    """Greedy speculative decoding with k drafts a pass over each answer: passes, the tokens they make after
    the first (which the prompt's forward makes), tokens per pass and forwards per token."""
    passes = tokens = 0
    for right in chain:
        at, n = 0, len(right)  # anchor index; the answer's tokens after the first are n - 1 ... see below
        while at < n - 1:
            step = min(right[at], k, n - 2 - at) + 1
            passes += 1
            tokens += step
            at += step
    return {"passes": passes, "tokens": tokens, "tokens_per_pass": round(tokens / max(1, passes), 3),
            "forwards_per_token": round(passes / max(1, tokens), 3)}


def acceptance_table(head: EagleHead, data: Features, ks: range = range(1, 7)) -> dict[str, dict[str, float]]:
    """speculate() for each k, on chains of the largest k (a shorter chain is its prefix)."""
    chain = chains(head, data, max(ks))
    return {str(k): speculate(chain, k) for k in ks}
