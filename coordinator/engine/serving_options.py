"""How the engine serves requests, as one typed value: how many at once, how many wait, the pipelining and the
drafting. The command line's serving flags are made from its fields (deltafin/cli/flags.py), the Python API builds it
from keywords. Light to import (no torch), so that `--help` is made from it at once."""

from __future__ import annotations

from dataclasses import dataclass

from deltafin.errors import DeltafinError
from deltafin.options import PREFILL_BATCHES, check_choice, opt
from deltafin.plan.memory.sizing_options import SPECULATIVE_TOKENS
from deltafin.text.chat import SERVING_MAX_TOKENS
from deltafin.text.drafting import MODES

SPECULATIVE_HELP = (
    "draft: a learned draft head (--draft-model) proposes tokens from the model's own hidden states; ngram: drafts "
    "from the prompt and the output so far; either way several tokens are verified in one forward (the same output; "
    "fewer passes over the weights when drafts land; the plan gives every sequence room for a verification's KDA "
    "trail, 0.21 GB at K3's width); none: one token per forward (default)")


@dataclass(frozen=True)
class ServingOptions:
    """How the engine serves requests: how many at once, how many wait, the pipelining and drafting (their
    context is the plan's: --max-context, a stage option). Checked when built, before anything loads."""

    speculative: str = opt("none", SPECULATIVE_HELP, choices=MODES)  # how requests that do not say draft
    max_active: int = opt(4, "requests generating at once; their steps are batched (default %(default)s)")
    queue_depth: int = opt(16, "requests waiting for a slot; more are refused with 429 (default %(default)s)")
    pipeline_depth: int = opt(
        0, "batches in flight through the stages at once (default 0: one per stage that computes beside the "
        "others, so every stage works; CPU workers on one host share its cores and count once; 1: one batch of all "
        "active requests)")
    prefill_batches: str = opt(
        "ride", "ride: running streams' decode steps go in the same batch as the next prompt chunk (default; at "
        "K3's sizes a chunk reads nearly every expert, so the steps cost no reads); separate: prompt chunks and "
        "decode steps take turns in batches of their own", choices=PREFILL_BATCHES)
    default_max_tokens: int = opt(
        SERVING_MAX_TOKENS, "max tokens for chat requests that do not say (default %(default)s: at K3's fraction of a "
        "token per second, more is hours)")
    served_model_name: str | None = opt(
        None, "the model id responses carry (default: the model directory's name); requests may name any model")
    strict_model_name: bool = opt(False, "answer 404 model_not_found to a request that names another model")
    draft_model: str | None = opt(
        None, "the draft head for --speculative draft: a directory with config.json and model.safetensors in the "
        "EAGLE-3 layout (docs/speculative-decoding.md says which fields; default: the model's own draft/ folder, "
        "which k3-mini ships)", metavar="DIR")
    max_drafts: int = 8  # drafted tokens one speculative forward verifies at most

    def __post_init__(self) -> None:
        if self.speculative not in MODES:
            raise DeltafinError(f"unknown speculative mode {self.speculative!r}: {', '.join(MODES)}")
        check_choice("prefill_batches", self.prefill_batches, PREFILL_BATCHES)
        if (self.max_active < 1 or self.queue_depth < 0 or self.default_max_tokens < 1 or self.pipeline_depth < 0):
            raise DeltafinError("--max-active and --default-max-tokens must be >= 1, --queue-depth and "
                                "--pipeline-depth >= 0")

    @property
    def speculative_tokens(self) -> int:
        """Tokens one speculative forward verifies, for the memory plan: the most when drafting, else 0."""
        return SPECULATIVE_TOKENS if self.speculative != "none" else 0
