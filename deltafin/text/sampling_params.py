"""A request's sampling parameters, as one typed value checked when built: the HTTP APIs map their bodies to it, the
command line's sampling flags are made from its fields (deltafin/cli/flags.py). Light to import (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from deltafin.errors import SamplingError
from deltafin.options import opt

MIN_TEMPERATURE = 1e-5  # below this, sampling is the argmax (logits / 1e-300 are infinities, and NaN after)


@dataclass(frozen=True)
class SamplingParams:
    """How a request chooses its tokens (sampling.py applies them, in the order its docstring gives)."""

    temperature: float = opt(1.0, "0 is greedy (default %(default)s)")
    top_k: int = opt(0, "keep the k most likely tokens (0: off)")
    top_p: float = opt(1.0, "nucleus sampling: keep the top tokens up to this mass")
    min_p: float = opt(0.0, "drop tokens below this fraction of the best one's p")
    repetition_penalty: float = opt(1.0, "divide the logits of tokens already in the prompt or output by this")
    presence_penalty: float = opt(0.0, "subtract this from the logits of tokens already in the output")
    frequency_penalty: float = opt(0.0, "subtract this times its count from each output token's logit")
    seed: int | None = opt(None, "seed for sampling (same seed, same output)")
    logprobs: int | None = None  # None: none; n >= 0: the chosen token's logprob and the top n
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's logit_bias

    def __post_init__(self) -> None:
        checks = [
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be between 0 and 100"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 disables it)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be between -2 and 2"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be between -2 and 2"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be between 0 and 20"),
            ("seed", self.seed is None or 0 <= self.seed < 2**64, "must be between 0 and 2^64 - 1"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise SamplingError(name, f"{name} {why} (got {getattr(self, name)!r})")
        for token, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise SamplingError("logit_bias", f"logit_bias values must be between -100 and 100 (got {bias})")
            if token < 0:
                raise SamplingError("logit_bias", f"logit_bias keys must be token ids >= 0 (got {token})")

    @property
    def greedy(self) -> bool:
        """Argmax: temperature 0 (or below MIN_TEMPERATURE, where dividing by it overflows), or top_k 1."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1
