"""What a generation yields (coordinator/engine/token_loop.py `generate`): a `TokenEvent` per token, then one
`Finished` with the usage, timing and drafting counts; a prefill's `PrefillProgress`; and `gathered`, a whole
reply from its events."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from deltafin.text.chat import Delta
from deltafin.text.drafting import DraftLength
from deltafin.text.sampling import Choice


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    delta: Delta
    choice: Choice  # the id again, with its logprob and the top alternatives when asked for
    logits: torch.Tensor | None = None  # fp32 [vocab] when the request asks for them (tests, tools)
    stop: bool = False  # the stop token that ended the generation: not part of the output (nor its logprobs)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens resumed from a kept prefix instead of prefilled
    cache_created_tokens: int = 0  # prompt tokens past those whose state this request kept for later requests

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timing:
    prefill_s: float  # the prompt's forward, including the first token's logits
    decode_s: float  # every later forward

    decode_steps: int = 0  # forwards after the prefill (the first token comes from the prefill)

    @property
    def tokens_per_second(self) -> float:
        return 0.0 if self.decode_s <= 0 else self.decode_steps / self.decode_s

    @property
    def seconds_per_token(self) -> float:
        return 0.0 if self.decode_steps == 0 else self.decode_s / self.decode_steps


@dataclass
class Drafting:
    """Speculative decoding's counts for one request."""

    draft_tokens: int = 0  # drafted tokens verified
    accepted_tokens: int = 0  # of them, taken
    forwards: int = 0  # forwards after the prefill (one per token without drafts)

    def note(self, drafted: int, accepted: int, lengths: DraftLength | None = None) -> int:
        """A pass verified `drafted` drafts and took `accepted`; the draft-length controller hears it too."""
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if lengths is not None:
            lengths.update(drafted, accepted)
        return accepted


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" | "length"
    usage: Usage
    delta: Delta  # text held back until the end (an incomplete character, a partial stop-string match)
    timing: Timing
    stopped_by: int | str | None = None  # the stop token id or stop string that ended it
    drafting: Drafting = field(default_factory=Drafting)


async def gathered(events: AsyncIterator[TokenEvent | Finished],
                   each: Callable[[TokenEvent | Finished], None] | None = None) -> tuple[Delta, Finished]:
    """A whole reply from its events (a response that is not streamed): their deltas joined, and the event that
    finished it. `each` sees every event on the way (logprobs, counts)."""
    reasoning, content, calls, end = [], [], [], None
    async for e in events:
        reasoning.append(e.delta.reasoning)
        content.append(e.delta.content)
        calls += e.delta.tool_calls
        if each is not None:
            each(e)
        if isinstance(e, Finished):
            end = e
    if end is None:
        raise RuntimeError("a reply's events ended without Finished")
    return Delta("".join(reasoning), "".join(content), calls), end


@dataclass(frozen=True)
class PrefillProgress:
    """How far a prompt's prefill is: prompt tokens in the caches (resumed ones included; a forward's part counted
    as its layers go) and the expert bytes its forwards read (expected, for a uniform router: every forward of a
    few hundred tokens reads nearly every expert, so bytes, not tokens, say how long the rest takes)."""

    tokens_done: float
    tokens_total: int
    bytes_done: float
    bytes_total: float

    @property
    def finished(self) -> bool:
        return self.tokens_done >= self.tokens_total
