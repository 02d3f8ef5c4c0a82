"""How one prompt is continued, as one typed value whoever asks: the HTTP APIs (their Params' `generation`), the
Python API and the commands all hand the engine a Generation (engine.py `run`), never a spread of keywords."""

from __future__ import annotations

from dataclasses import dataclass

from deltafin.text.sampling_params import SamplingParams


@dataclass(frozen=True)
class Generation:
    """The limit, the sampling, the stop strings, and what to return besides the tokens; the engine fills what is
    None (its default limit, capped by the context left; greedy sampling; its --speculative)."""

    max_tokens: int | None = None
    sampling: SamplingParams | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # generate `max_tokens` whatever the model says (the benchmarks)
    return_logits: bool = False  # each token's logits with its event
    speculative: str | None = None  # none | ngram | draft for this request (None: the engine's)


GREEDY = Generation()  # the engine's default limit, greedy, no stop strings
