"""Speculative decoding without a draft model: drafts from the text so far, and how many to draft.

A pass feeds the last token and k drafted ones in one forward; the stages return logits for every position
and can continue from any of them (stage_io.SeqInput.speculative). The sampler accepts a prefix of the drafts
(`Sampler.verify`: exact for greedy and for sampling), so the output is what plain decoding would give.

- `Drafter` is what proposes tokens; `NgramDrafter` is prompt lookup: the continuation of the latest earlier
  occurrence of the last n tokens (n from `max_ngram` down to `min_ngram`) in the prompt and the output so
  far. A learned draft head (runtime/head_drafter.py, `HeadDrafter`) reads the target's own hidden states at a few
  layers as well: it names them (`feature_layers`) and hears them after every forward (`observe`).
- `DraftLength` picks k for the next pass: the k that maximises expected tokens per second, from the
  acceptance measured so far (per confidence, where the drafter gives one: `Calibration`) and a cost model of
  one pass (a `Cost`). At K3's size a pass costs the
  spine's reads once, whatever k, plus the distinct experts its k+1 tokens route to: with a uniform router
  E·(1−(1−K/E)^(k+1)) per layer, so drafting is cheap where the spine streams and dear where it does not.
  The engine prices a pass with the plan it runs (`PlannedCost`: plan/timing/predict.py's pass_seconds, the experts
  the caches do not hold read at the disks' speed, the compute as measured) and then with what its passes take
  (`FittedCost`: the plan's two ends as a prior, corrected by every pass timed); `PassCost` is the same shape with
  the split of one 64 GB Mac's plan, where no plan prices it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

MODES = ("none", "ngram", "draft")
DRAFT_CONTEXT = 256  # a prompt's last positions whose hidden states a draft head is given (its attention's reach)


@dataclass(frozen=True)
class Drafts:
    """What a drafter proposes: tokens, and where it can say, its probability for each given the ones before it
    (a learned head's softmax at the token it chose; None for prompt lookup, which has no such number)."""

    tokens: list[int] = field(default_factory=list)
    confidence: list[float] | None = None


class Drafter(Protocol):
    feature_layers: tuple[int, ...]  # the target's layers whose entering hidden states it reads; () for none

    def propose(self, tokens: list[int], k: int) -> Drafts:
        """Up to k tokens that may follow `tokens` (the prompt and the output so far); none for no guess."""
        ...

    def observe(self, text: Sequence[int], start: int, features: Mapping[int, Any]) -> None:
        """The target's hidden states (layer -> [n, D]) at the text's positions [start, start + n), each followed
        in `text` (the prompt and the output so far) by its next token: what the last forward verified."""
        ...

    def done(self, text: Sequence[int]) -> None:
        """The request ended with `text`."""
        ...


@dataclass(frozen=True)
class NgramDrafter:
    max_ngram: int = 3
    min_ngram: int = 1
    window: int = 4096  # look this far back (a long prompt stays cheap to search)
    feature_layers: tuple[int, ...] = ()

    def observe(self, text: Sequence[int], start: int, features: Mapping[int, Any]) -> None:
        pass  # the text is all it reads

    def done(self, text: Sequence[int]) -> None:
        pass

    def propose(self, tokens: list[int], k: int) -> Drafts:
        if k < 1 or len(tokens) < 2:
            return Drafts()
        recent = tokens[-self.window:]
        for n in range(min(self.max_ngram, len(recent) - 1), self.min_ngram - 1, -1):
            tail = recent[-n:]
            for start in range(len(recent) - n - 1, -1, -1):  # the latest occurrence before the tail itself
                if recent[start:start + n] == tail:
                    return Drafts(recent[start + n:start + n + k])
        return Drafts()


def distinct_experts(tokens: int, experts: int, active: int) -> float:
    """Experts a layer reads for `tokens` tokens under a uniform router."""
    return experts * (1.0 - (1.0 - active / experts) ** tokens)


class Cost(Protocol):
    def seconds(self, tokens: int) -> float:
        """One verification pass of `tokens` tokens (the token fed and its drafts)."""
        ...

    def describe(self) -> str:
        """The model in words, with what it says a pass of 0, 1, 2, 4 and 8 drafts costs."""
        ...


@dataclass(frozen=True)
class PlannedCost:
    """A pass's seconds for 1, 2, ... tokens as the plan predicts them (ClusterPlan.verify); longer passes cost as the
    longest priced."""

    table: tuple[float, ...]

    def seconds(self, tokens: int) -> float:
        return self.table[min(max(tokens, 1), len(self.table)) - 1]

    def describe(self) -> str:
        return ", ".join(f"k={k} {s:.3g} s" for k, s in enumerate(self.table))


@dataclass
class FittedCost:
    """A pass's seconds as `PassCost`'s shape, fixed + per_expert x distinct experts of its tokens, fitted by least
    squares to the passes timed (`observe`), older ones decaying, from the plan's prediction at 1 and `longest`
    tokens counted as `prior_weight` passes each: what the plan says until passes say otherwise (a plan's compute
    model misses a small model's per-forward overheads; a busy machine makes every pass slower). Shared by every
    request of an engine."""

    prior: Cost
    experts: int
    active: int
    longest: int = 9
    prior_weight: float = 2.0
    decay: float = 0.98
    passes: int = field(init=False, default=0)
    _sums: list[float] = field(init=False)  # weight, x, y, xx, xy

    def __post_init__(self) -> None:
        self._sums = [0.0] * 5
        for n in (1, self.longest):
            self._add(n, self.prior.seconds(n), self.prior_weight)

    def _add(self, tokens: int, seconds: float, weight: float) -> None:
        x = distinct_experts(tokens, self.experts, self.active)
        for i, v in enumerate((1.0, x, seconds, x * x, x * seconds)):
            self._sums[i] += weight * v

    def observe(self, tokens: int, seconds: float) -> None:
        """A pass of `tokens` tokens took `seconds`."""
        self._sums = [self.decay * v for v in self._sums]
        self._add(tokens, seconds, 1.0)
        self.passes += 1

    @property
    def terms(self) -> tuple[float, float]:
        """(fixed, per_expert) as fitted; the slope never negative (more experts never cost less)."""
        w, x, y, xx, xy = self._sums
        spread = w * xx - x * x
        slope = max(0.0, (w * xy - x * y) / spread) if spread > 1e-12 else 0.0
        return (y - slope * x) / w, slope

    def seconds(self, tokens: int) -> float:
        fixed, slope = self.terms
        return max(fixed + slope * distinct_experts(tokens, self.experts, self.active), 1e-6)

    def describe(self) -> str:
        fixed, slope = self.terms
        return (f"{fixed * 1e3:.3g} ms + {slope * 1e3:.3g} ms an expert of a layer the pass reads ({self.passes} "
                f"passes timed): " + ", ".join(f"k={k} {self.seconds(k + 1) * 1e3:.3g} ms" for k in (0, 1, 2, 4, 8)))


@dataclass(frozen=True)
class PassCost:
    """Seconds of one verification pass of n tokens: `fixed` (the spine's streamed part, the hops, the
    head) plus `per_expert` for each distinct expert read, per MoE layer (`experts` of which `active` per
    token)."""

    fixed: float
    per_expert: float
    experts: int
    active: int

    def seconds(self, tokens: int) -> float:
        return self.fixed + self.per_expert * distinct_experts(tokens, self.experts, self.active)

    def describe(self) -> str:
        return (f"{self.fixed:.3g} + {self.per_expert:.3g} an expert of a layer the pass reads: "
                + ", ".join(f"k={k} {self.seconds(k + 1):.3g}" for k in (0, 1, 2, 4, 8)))


def reads_cost(experts: int, active: int) -> PassCost:
    """A pass priced by the experts it reads alone, one token's reads being 1: one 64 GB Mac's plan at K3's size,
    whose spine stays resident and whose token is 25.6 GB of expert reads (docs/speculative-decoding.md), where a
    draft pays only if it saves reads."""
    return PassCost(fixed=0.0, per_expert=1.0 / active, experts=experts, active=active)


def chain_tokens(acceptances: Sequence[float]) -> float:
    """Tokens one pass yields when draft i is accepted with probability acceptances[i] given the ones before
    it (a chain stops at its first rejection): 1 + a0 + a0·a1 + ..."""
    total, run = 1.0, 1.0
    for a in acceptances:
        run *= min(max(a, 0.0), 1.0)
        total += run
    return total


def default_cost(experts: int, active: int) -> PassCost:
    """Half of a one-token pass fixed, half its experts: about one 64 GB Mac's split at K3's size (its MPS plan
    streams 36.8 GB of spine and 25.8 GB of experts per token; docs/speculative-decoding.md)."""
    return PassCost(fixed=1.0, per_expert=1.0 / active, experts=experts, active=active)


@dataclass
class Calibration:
    """How often a drafter's drafts are taken, by the confidence p it gave them, in slices of equal steps of
    -log2(1 - p) (half a bit each: [0, 0.29), [0.29, 0.5), [0.5, 0.65), ... up to 1 - 2^-8, then the rest), since a
    trained head puts most drafts near p = 1, where a slice of 0.9-1.0 would hide the difference between 0.9
    and 0.999. Each slice starts from `prior` (what the head's recipe measured on answers it was not trained
    on: `shipped`) or else its middle (a head trained on the model's own answers is about calibrated), worth
    `prior_weight` drafts, then counts every judged draft (those up to a pass's first rejection). One per engine
    and drafter: every request's passes teach it."""

    bins: int = 17
    prior_weight: float = 4.0
    prior: Sequence[float] | None = None  # the share taken each slice starts from (None: its middle)
    taken: list[float] = field(init=False)
    judged: list[float] = field(init=False)

    def __post_init__(self) -> None:
        if self.prior is not None and len(self.prior) != self.bins:
            raise ValueError(f"a calibration prior has {self.bins} slices, not {len(self.prior)}")
        prior = self.prior or [(self.edge(i) + self.edge(i + 1)) / 2 for i in range(self.bins)]
        self.judged = [self.prior_weight] * self.bins
        self.taken = [min(max(p, 0.0), 1.0) * self.prior_weight for p in prior]

    @classmethod
    def shipped(cls, slices: Sequence[Mapping[str, float]]) -> Calibration:
        """From a measured calibration as `describe` gives it (a head's config.json: `deltafin_trained.calibration`);
        ValueError where its slices are not these."""
        edges = [round(cls().edge(i), 4) for i in range(cls.bins)]
        try:
            got = [round(float(s["confidence"]), 4) for s in slices]
            shares = [float(s["taken"]) for s in slices]
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"a calibration is a list of {{confidence, taken}} slices ({e})") from None
        if got != edges:
            raise ValueError(f"a calibration's slices start at {got}, not at {edges}")
        return cls(prior=shares)

    def edge(self, i: int) -> float:
        """The lowest confidence of slice i (1.0 past the last)."""
        return 1.0 if i >= self.bins else 1.0 - 2.0 ** (-i / 2)

    def _bin(self, confidence: float) -> int:
        surprise = -math.log2(max(1.0 - confidence, 1e-12))
        return min(max(int(2 * surprise), 0), self.bins - 1)

    def acceptance(self, confidence: float) -> float:
        """The chance a draft given `confidence` is taken, as measured."""
        i = self._bin(confidence)
        return self.taken[i] / self.judged[i]

    def update(self, confidence: Sequence[float], accepted: int) -> None:
        """A pass verified drafts of these confidences and took the first `accepted`."""
        for i, c in enumerate(confidence[:accepted + 1]):
            b = self._bin(c)
            self.judged[b] += 1.0
            self.taken[b] += 1.0 if i < accepted else 0.0

    def describe(self) -> list[dict[str, float]]:
        """Per confidence slice (its lowest confidence): drafts judged and the share taken (the prior counted)."""
        return [{"confidence": round(self.edge(i), 4), "judged": round(self.judged[i] - self.prior_weight, 1),
                 "taken": round(self.taken[i] / self.judged[i], 3)} for i in range(self.bins)]


@dataclass
class DraftLength:
    """The number of drafts for the next pass: the k in [0, max_k] with the most expected tokens per second under
    the cost model. A draft's acceptance is, where the drafter gives a confidence and a `calibration` is kept,
    what drafts of that confidence got so far (so a head drafts long where it is sure and not at all where it is
    not); else the share of drafts taken, each pass's tokens up to its first rejection counting (later ones were
    never judged), older passes decaying."""

    cost: Cost
    max_k: int = 8
    calibration: Calibration | None = None
    prior: float = 0.5  # the acceptance assumed before any pass, worth `prior_weight` drafts
    prior_weight: float = 4.0
    decay: float = 0.9  # per pass: recent passes count more (a conversation changes character)
    probe_every: int = 8
    probe_sure: float = 0.99  # the least confidence of a calibrated drafter's probe
    taken: float = field(init=False)
    judged: float = field(init=False)
    _idle: int = field(init=False, default=0)
    _pending: list[float] = field(init=False, default_factory=list)  # the confidences of the drafts sent

    def __post_init__(self) -> None:
        self.taken, self.judged = self.prior * self.prior_weight, self.prior_weight

    @property
    def acceptance(self) -> float:
        return self.taken / self.judged

    def update(self, drafted: int, accepted: int) -> None:
        """After a pass: `accepted` of its `drafted` tokens were taken."""
        if drafted <= 0:
            return
        self.taken = self.decay * self.taken + accepted
        self.judged = self.decay * self.judged + accepted + (1 if accepted < drafted else 0)
        if self.calibration is not None and self._pending:
            self.calibration.update(self._pending[:drafted], accepted)
        self._pending = []

    def _calibrated(self, drafts: Drafts) -> bool:
        return drafts.confidence is not None and self.calibration is not None

    def _acceptances(self, drafts: Drafts) -> list[float]:
        if self._calibrated(drafts):
            return [self.calibration.acceptance(c) for c in drafts.confidence]
        return [self.acceptance] * len(drafts.tokens)

    def next(self, drafts: Drafts) -> int:
        """How many of `drafts` to verify. When none pay, every `probe_every`-th such step still verifies one, so
        that a text that turns repetitive is noticed; a calibrated drafter's only when its first draft is one the
        head is sure of (`probe_sure`): whether those land is what drafting long hangs on, and a few early
        misses must not end it, while a draft the head doubts would read for little."""
        available = min(self.max_k, len(drafts.tokens))
        acceptances = self._acceptances(drafts)
        best, best_rate = 0, 1.0 / self.cost.seconds(1)
        for k in range(1, available + 1):
            rate = chain_tokens(acceptances[:k]) / self.cost.seconds(k + 1)
            if rate > best_rate:
                best, best_rate = k, rate
        if best == 0 and available and (not self._calibrated(drafts) or drafts.confidence[0] >= self.probe_sure):
            self._idle += 1
            if self._idle >= self.probe_every:
                self._idle, best = 0, 1
        self._pending = list(drafts.confidence[:best]) if drafts.confidence is not None else []
        return best
