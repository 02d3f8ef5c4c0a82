"""The token loop: prefill the prompt, then one forward per token, over any Backend.

`generate` is an async generator of events: a `TokenEvent` per generated token (id, text that is safe
to print, and its logits if asked), then one `Finished` with the reason and usage. Closing the
generator early (a cancelled request, a client that went away) releases the session on every stage.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from deltafin.stage import SeqInput
from deltafin.tokenizer import K3Tokenizer, StreamDecoder

from .backend import Backend


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # complete characters only (a multi-byte character split over tokens waits for its end)
    logits: torch.Tensor | None = None  # fp32 [vocab], when asked for


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" | "length"
    usage: Usage
    text: str = ""  # characters still held back by the stream decoder
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        n = self.usage.completion_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


Chooser = Callable[[torch.Tensor, list[int]], int]  # (logits [vocab], tokens so far) -> next id


def greedy(logits: torch.Tensor, history: list[int]) -> int:
    return int(logits.argmax())


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int = 64
    stop_ids: frozenset[int] = frozenset()
    choose: Chooser = greedy
    return_logits: bool = False
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)


async def generate(backend: Backend, tokenizer: K3Tokenizer | None, req: Request) -> AsyncIterator[
        TokenEvent | Finished]:
    if not req.prompt_ids:
        raise ValueError("the prompt is empty")
    decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
    history = list(req.prompt_ids)
    produced = 0
    reason = "length"
    t0 = time.monotonic()
    t_prefill = 0.0
    try:
        logits = (await backend.forward([SeqInput(req.session_id, 0, ids=torch.tensor(history))]))[0].logits
        t_prefill = time.monotonic() - t0
        while produced < req.max_tokens:
            row = logits[-1].float()
            token = req.choose(row, history)
            produced += 1
            history.append(token)
            text = decoder.push(token) if decoder is not None else ""
            yield TokenEvent(token, text, row if req.return_logits else None)
            if token in req.stop_ids:
                reason = "stop"
                break
            if produced >= req.max_tokens:
                break
            step = SeqInput(req.session_id, len(history) - 1, ids=torch.tensor([token]))
            logits = (await backend.forward([step]))[0].logits
        tail = decoder.flush() if decoder is not None else ""
        yield Finished(reason, Usage(len(req.prompt_ids), produced), tail, t_prefill,
                       time.monotonic() - t0 - t_prefill)
    finally:
        await backend.release([req.session_id])
