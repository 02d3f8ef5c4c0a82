"""Choosing the next token: penalties, temperature, top-k, top-p, min-p, seeded sampling, logprobs.

Order (as vLLM and llama.cpp apply them): repetition penalty (prompt and output tokens), presence and
frequency penalties (output tokens, OpenAI's definition), temperature, then top-k, top-p and min-p
filters, then a draw from a per-request seeded generator. Temperature 0 is greedy. Logprobs are of the
model's own distribution (log-softmax of the raw logits), as OpenAI reports them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from deltafin.errors import SamplingError
from deltafin.text.sampling_params import SamplingParams


@dataclass(frozen=True)
class Choice:
    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) best first


@dataclass
class Sampler:
    """One request's sampler: its parameters, its seeded generator and its token counts."""

    params: SamplingParams
    prompt_ids: list[int]
    generator: torch.Generator = field(init=False)
    counts: dict[int, int] = field(default_factory=dict)  # output tokens

    def __post_init__(self) -> None:
        seed = self.params.seed if self.params.seed is not None else random.SystemRandom().randrange(2**63)
        self.generator = torch.Generator().manual_seed(seed)
        self._seen = torch.tensor(sorted(set(self.prompt_ids)), dtype=torch.long)

    def __call__(self, logits: torch.Tensor) -> Choice:
        raw, scores = self._scores(logits)
        if self.params.greedy:
            token = int(scores.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(scores, -1), 1, generator=self.generator))
        return self._chosen(raw, token)

    def verify(self, logits: torch.Tensor, draft: int) -> tuple[Choice, bool]:
        """The token at a position where `draft` was proposed, and whether it is the draft. Greedy: the
        argmax. Sampling (speculative sampling with a draft that is certain, q = 1 at the draft): accept it
        with probability p(draft), else sample from p with the draft removed; either way the token is
        distributed as p, exactly as `__call__` would draw it."""
        raw, scores = self._scores(logits)
        if self.params.greedy:
            token = int(scores.argmax())
        else:
            probs = torch.softmax(scores, -1)
            u = float(torch.rand((), generator=self.generator))
            if u < float(probs[draft]):
                token = draft
            else:
                rest = probs.clone()
                rest[draft] = 0.0
                token = int(torch.multinomial(rest, 1, generator=self.generator))
        return self._chosen(raw, token), token == draft

    def _scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits as fp32 on the CPU, and the scores a token is chosen from: penalized, and when sampling
        also tempered and filtered (top-k, top-p, min-p)."""
        raw = logits.detach().float().cpu()
        scores = self._penalized(raw)
        if not self.params.greedy:
            scores = self._filtered(scores / self.params.temperature)
        return raw, scores

    def _chosen(self, raw: torch.Tensor, token: int) -> Choice:
        p = self.params
        self.counts[token] = self.counts.get(token, 0) + 1
        if p.logprobs is None:
            return Choice(token)
        lp = torch.log_softmax(raw, -1)
        top = torch.topk(lp, p.logprobs) if p.logprobs else None
        pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else ()
        return Choice(token, float(lp[token]), pairs)

    def _penalized(self, scores: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.logit_bias:
            scores = scores.clone()
            for token, bias in p.logit_bias:
                if token >= scores.numel():
                    raise SamplingError("logit_bias", f"logit_bias token {token} is outside the vocabulary")
                scores[token] += bias
        if p.repetition_penalty != 1.0:
            seen = torch.cat([self._seen, torch.tensor(list(self.counts), dtype=torch.long)]).unique()
            s = scores[seen]
            scores = scores.clone()
            scores[seen] = torch.where(s > 0, s / p.repetition_penalty, s * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long)
            n = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            scores = scores.clone()
            scores[ids] -= p.presence_penalty + p.frequency_penalty * n
        return scores

    def _filtered(self, scores: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.top_k and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            order = scores.argsort(descending=True)
            probs = torch.softmax(scores[order], -1)
            beyond = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix reaching top_p
            scores = scores.clone()
            scores[order[beyond]] = float("-inf")
        if p.min_p > 0.0:
            probs = torch.softmax(scores, -1)
            scores = scores.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        return scores


class StopMatcher:
    """Stop strings over streamed text: releases text only when it cannot be the start of a stop string.

    Each stop string has a Knuth-Morris-Pratt automaton whose state is the longest prefix of it the text ends
    with, so every generated character costs O(1) per stop string (amortized): linear time however long the
    strings and the text. The first stop string to be completed ends the text, before it (of several completed
    by the same character, the longest)."""

    def __init__(self, stops: list[str]):
        if any(not s for s in stops):
            raise SamplingError("stop", "stop strings must not be empty")
        self.stops = stops
        self.fail = [_failure(s) for s in stops]
        self.state = [0] * len(stops)  # matched prefix length of each stop string
        self.pending = ""  # text held back: it may be the start of a stop string

    def push(self, text: str) -> tuple[str, str | None]:
        """Add generated text; returns (text safe to emit, the stop string reached or None). After a stop
        string, the text before it is returned and the rest is dropped."""
        start = len(self.pending)
        self.pending += text
        for at in range(start, len(self.pending)):
            ch, done = self.pending[at], None
            for i, s in enumerate(self.stops):
                k = self.state[i]
                while k and s[k] != ch:
                    k = self.fail[i][k - 1]
                k = k + 1 if s[k] == ch else 0
                if k == len(s) and (done is None or len(s) > len(done)):  # of those ending here, the longest
                    done = s
                self.state[i] = k % len(s)
            if done is not None:
                out, self.pending, self.state = self.pending[:at + 1 - len(done)], "", [0] * len(self.stops)
                return out, done
        hold = max(self.state, default=0)
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _failure(s: str) -> list[int]:
    """KMP's failure function: for each prefix s[:i+1], the length of its longest proper prefix that is also
    its suffix."""
    out, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = out[k - 1]
        if s[i] == s[k]:
            k += 1
        out[i] = k
    return out
