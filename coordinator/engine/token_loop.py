"""The token loop: prefill the prompt, then one forward per token (or, speculating, per pass: the last
token and the drafts after it, verified at once; the sampler takes a prefix of them), over any Backend.

`generate` is an async generator of events:

- `TokenEvent` per generated token: its id, the text it released (`delta`: reasoning, response text and
  finished tool calls, as the request's `TextView` splits them; never half a UTF-8 character, never text
  that might still turn into a stop string), its logprob and top alternatives when asked for.
- `Finished` once at the end: why (`stop` on a stop token or stop string, `length` at max_tokens), the
  text still held back, token usage, timing and the drafting counts.

Stop strings match the response text only (the `content` of a delta; reasoning is never cut). The stop
token and the stop string themselves are not part of the output. Closing the generator early (a
cancelled request, a client that went away) releases the session on every stage, as does finishing.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from deltafin.coordinator.engine.events import Drafting, Finished, PrefillProgress, Timing, TokenEvent, Usage
from deltafin.coordinator.engine.prefix_index import PrefixSession
from deltafin.plan.timing.predict import forward_lengths
from deltafin.runtime.features import FeatureAsk, Features
from deltafin.runtime.stage_io import SeqInput, SeqOutput
from deltafin.text.chat import Delta
from deltafin.text.drafting import DRAFT_CONTEXT, Drafter, DraftLength
from deltafin.text.sampling import Sampler, StopMatcher
from deltafin.text.sampling_params import SamplingParams
from deltafin.text.tokenizer import K3Tokenizer, StreamDecoder
from deltafin.transport.grpc_status import is_prefix_missing

# One sequence's forward, batched with other requests' by the scheduler (or run alone).
Forward = Callable[..., Awaitable[SeqOutput]]  # (item, progress=...): the scheduler's forward
# Free a session, or keep its state as the prefix named by the second argument, of its first (third) tokens.
Release = Callable[[str, str | None, int], Awaitable[None]]


class Pipelined(Protocol):
    """Where one sequence's consecutive forwards may go through the stages at once (the scheduler:
    coordinator/cluster/pipelined.py): whether a prompt of that many forwards does now, and sending them so."""

    def pipelines(self, forwards: int) -> bool: ...

    async def prompt(self, items: list[SeqInput],
                     progress: list[Callable[[float], None]] | None = None) -> list[SeqOutput]: ...


class TextView(Protocol):
    """Turns generated token ids into text deltas (plain text, or the chat format's channels)."""

    def push(self, token_id: int) -> Delta: ...

    def flush(self) -> Delta: ...


class PlainText:
    """All output is response text; special tokens are left out (as OpenAI-style servers do)."""

    def __init__(self, tokenizer: K3Tokenizer, skip_special: bool = True):
        self.decoder = StreamDecoder(tokenizer, skip_special=skip_special)

    def push(self, token_id: int) -> Delta:
        return Delta(content=self.decoder.push(token_id))

    def flush(self) -> Delta:
        return Delta(content=self.decoder.flush())


class _NoText:
    def push(self, token_id: int) -> Delta:
        return Delta()

    def flush(self) -> Delta:
        return Delta()


@dataclass
class Speculation:
    """How a request drafts: the drafter and the draft-length controller (deltafin/text/drafting.py)."""

    drafter: Drafter
    lengths: DraftLength


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int = 64
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    stop_ids: frozenset[int] = frozenset()
    stop_strings: list[str] = field(default_factory=list)
    return_logits: bool = False
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    prefill_chunk: int | None = None  # most prompt tokens per forward (the stages' sizing); None: all at once
    prefix: PrefixSession | None = None  # resume from and keep prefixes (prefix_index.py); None: never
    progress: Callable[[PrefillProgress], None] | None = None  # how far the prefill is (each chunk, and within)
    forward_bytes: Callable[[int], float] | None = None  # expected expert bytes a forward of N prompt tokens reads
    speculation: Speculation | None = None  # draft tokens and verify them in one forward; None: one at a time
    pipelined: Pipelined | None = None  # a prompt of several forwards sends them through the stages at once


class _Output:
    """What one request has generated: the sampler's choices, turned into text and checked against the stop
    tokens, the stop strings and max_tokens."""

    def __init__(self, req: Request, view: TextView):
        if not req.prompt_ids:
            raise ValueError("the prompt is empty")
        if req.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self.req, self.view = req, view
        self.sampler = Sampler(req.sampling, req.prompt_ids)
        self.stops = StopMatcher(req.stop_strings) if req.stop_strings else None
        self.tokens: list[int] = []
        self.reason: str = "length"
        self.stopped_by: int | str | None = None

    def judge(self, rows: torch.Tensor, drafts: list[int]) -> tuple[list[TokenEvent], bool]:
        """The tokens of one forward's rows (a row per draft, then one more): each draft up to the first
        the sampler does not take, then the sampler's own. Returns their events and whether generation ended."""
        events = []
        for i, row in enumerate(rows):
            choice, accepted = self.sampler.verify(row, drafts[i]) if i < len(drafts) else (self.sampler(row), False)
            token = choice.token_id
            self.tokens.append(token)
            logits = row if self.req.return_logits else None
            if token in self.req.stop_ids:
                self.reason, self.stopped_by = "stop", token
                return [*events, TokenEvent(token, Delta(), choice, logits, stop=True)], True
            delta = self.view.push(token)
            if self.stops is not None and delta.content:
                delta.content, hit = self.stops.push(delta.content)
                if hit is not None:
                    self.reason, self.stopped_by = "stop", hit
                    return [*events, TokenEvent(token, delta, choice, logits)], True
            events.append(TokenEvent(token, delta, choice, logits))
            if len(self.tokens) >= self.req.max_tokens:
                return events, True
            if not accepted:  # the drafts after a rejected one followed the wrong token
                break
        return events, False

    def finished(self, timing: Timing, drafting: Drafting) -> Finished:
        tail = self.tail()
        prefix = self.req.prefix
        cached, created = (prefix.cached_tokens, prefix.created_tokens) if prefix is not None else (0, 0)
        return Finished(self.reason, Usage(len(self.req.prompt_ids), len(self.tokens), cached, created), tail, timing,
                        self.stopped_by, drafting)

    def tail(self) -> Delta:
        """Text held back until the end (an incomplete character, a partial stop-string match)."""
        if self.reason == "stop" and isinstance(self.stopped_by, str):
            return Delta()
        tail = self.view.flush()
        if self.stops is not None:
            tail.content, hit = self.stops.push(tail.content)
            tail.content += "" if hit is not None else self.stops.flush()
            if hit is not None:
                self.reason, self.stopped_by = "stop", hit
        return tail


async def generate(forward: Forward, release: Release, view: TextView | None, req: Request) -> AsyncIterator[
        TokenEvent | Finished]:
    text = _Output(req, view if view is not None else _NoText())
    length = len(req.prompt_ids)  # tokens the stages hold that belong to the text (drafts beyond it may follow)
    drafting = Drafting()
    t0 = time.monotonic()
    t_prefill = 0.0
    consistent = False  # every forward so far succeeded: the state has seen the prompt and `fed`
    fed: list[int] = []  # generated tokens fed back
    try:
        out = await _prefill(forward, release, req)
        fed_end = len(req.prompt_ids)  # the position after the last token the latest forward fed
        consistent = True
        t_prefill = time.monotonic() - t0
        drafts: list[int] = []  # what the last forward verified after its first token
        while True:
            events, ended = text.judge(out.logits[-len(drafts) - 1:].float(), drafts)  # type: ignore[index]
            for event in events:
                yield event
            if drafts:  # the drafts taken before the last token emitted are text; the stages drop the rest
                taken = drafting.note(len(drafts), len(events) - 1,
                                      req.speculation.lengths if req.speculation else None)
                fed += drafts[:taken]
                length += taken
            _observe(req.speculation, out, fed_end, req.prompt_ids + text.tokens)
            if ended:
                break
            token = text.tokens[-1]
            drafts = _drafts(req.speculation, req.prompt_ids + text.tokens, req.max_tokens - len(text.tokens))
            consistent = False
            item = SeqInput(req.session_id, length, ids=torch.tensor([token, *drafts]), speculative=bool(drafts),
                            features=_features_from(req.speculation, length))
            fed_end = length + 1 + len(drafts)
            started = time.monotonic()
            out = await (_first_step(forward, release, req, item) if not fed else forward(item))
            if fed:  # the first step may prefill again (a kept prefix gone): not a pass to price
                _timed(req.speculation, item.num_tokens, time.monotonic() - started)
            drafting.forwards += 1
            consistent = True
            fed.append(token)
            length += 1
        if req.speculation is not None:
            req.speculation.drafter.done(req.prompt_ids + text.tokens)
        yield text.finished(Timing(t_prefill, time.monotonic() - t0 - t_prefill, max(0, len(text.tokens) - 1)),
                            drafting)
    finally:
        if req.prefix is not None:
            req.prefix.resumed_done()  # a request cancelled before its first forward pinned its entry too
        keep = await req.prefix.finish(req.prompt_ids + fed) if req.prefix is not None and consistent else None
        await release(req.session_id, keep, length)


def _features_from(spec: Speculation | None, position: int) -> FeatureAsk | None:
    """What a forward asks for a drafter that reads the target's hidden states: its layers, from `position`."""
    layers = spec.drafter.feature_layers if spec is not None else ()
    return FeatureAsk(tuple(sorted(layers)), position) if layers else None


def _timed(spec: Speculation | None, tokens: int, seconds: float) -> None:
    """A decode step of `tokens` tokens took `seconds`: the pass cost learns it (drafting.FittedCost)."""
    observe = getattr(spec.lengths.cost, "observe", None) if spec is not None else None
    if observe is not None:
        observe(tokens, seconds)


def _observe(spec: Speculation | None, out: SeqOutput, fed_end: int, text: list[int]) -> None:
    """Hand the drafter the features of the rows the text kept (the rows of rejected drafts are dropped), each
    followed in `text` by its next token. `fed_end`: the position after the forward's last row."""
    if spec is None or not out.features:
        return
    rows = next(iter(out.features.values())).shape[0]
    first = fed_end - rows
    keep = min(rows, len(text) - 1 - first)
    if keep > 0:
        spec.drafter.observe(text, first, {layer: f[:keep] for layer, f in out.features.items()})


def _drafts(spec: Speculation | None, text: list[int], room: int) -> list[int]:
    """The drafts for the next forward: what the drafter proposes, as many as the cost model says pay, and
    no more than the tokens still to generate after the one fed (room - 1)."""
    if spec is None or room < 2:
        return []
    proposed = spec.drafter.propose(text, min(spec.lengths.max_k, room - 1))
    return proposed.tokens[:spec.lengths.next(proposed)]


async def _prefill(forward: Forward, release: Release, req: Request) -> SeqOutput:
    """Feed the prompt in the chunks the stages were sized for, from the kept prefix the request resumes
    (if any), keeping state where the prefix session asks. A prefix a stage no longer holds: start over. A
    prompt resumed whole feeds nothing: its kept logits are the first output's (the next forward resumes)."""
    prefix, length = req.prefix, len(req.prompt_ids)
    if prefix is not None and prefix.logits is not None:
        _PrefillReport(req, length, 1)
        return SeqOutput(req.session_id, logits=prefix.logits.view(1, -1))
    step, start = req.prefill_chunk or length, prefix.cached_tokens if prefix is not None else 0
    pos, out, progress = start, None, _PrefillReport(req, start, step)
    features: list[SeqOutput] = []  # each chunk's answer to the drafter's features
    if req.pipelined is not None and req.pipelined.pipelines(len(progress.ends)):
        out = await _pipelined(req, release, start, progress)
        if out is not None:
            return out
        start, pos, progress = 0, 0, _PrefillReport(req, 0, step)  # its kept prefix is gone: from the start
    while pos < length:
        end = progress.end_after(pos)
        item = await _chunk(req, pos, end, start)
        save, resume = item.save_at, item.resume_from
        try:
            out = await (forward(item, progress=progress.within(pos, end)) if req.progress else forward(item))
        except Exception as e:
            prefix.failed([pid for _, pid in save]) if prefix is not None else None
            if resume is None or not is_prefix_missing(e):
                raise
            prefix.missing()  # type: ignore[union-attr]
            await release(req.session_id, None, 0)  # stages that did resume hold a partial session
            start, pos, progress = 0, 0, _PrefillReport(req, 0, step)
            features.clear()
            continue
        finally:
            if resume is not None:
                prefix.resumed_done()  # type: ignore[union-attr]
        pos = end
        progress.at(pos)
        features.append(out)
    assert out is not None
    return dataclasses.replace(out, features=_joined(features))


async def _chunk(req: Request, pos: int, end: int, start: int) -> SeqInput:
    """The prompt's forward of tokens [pos, end): keeping the states its prefix session asks there, the first one
    (at `start`) resuming the kept prefix."""
    prefix = req.prefix
    save = await prefix.save_points(pos, end) if prefix is not None else ()
    resume = prefix.resumed.prefix_id if prefix is not None and prefix.resumed is not None and pos == start else None
    return SeqInput(req.session_id, pos, ids=torch.tensor(req.prompt_ids[pos:end]), resume_from=resume, save_at=save,
                    features=_features_from(req.speculation, max(0, len(req.prompt_ids) - DRAFT_CONTEXT)))


async def _pipelined(req: Request, release: Release, start: int, report: _PrefillReport) -> SeqOutput | None:
    """The prompt's forwards from `start` sent at once (`req.pipelined`), as `_prefill` sends them one by one;
    None where the kept prefix the first resumes from is gone (its partial session released)."""
    prefix = req.prefix
    items = [await _chunk(req, pos, end, start) for pos, end in zip([start, *report.ends], report.ends, strict=False)]
    assert req.pipelined is not None
    try:
        outs = await req.pipelined.prompt(items, _slowest(report, items) if req.progress else None)
    except Exception as e:
        if prefix is not None:
            prefix.failed([pid for item in items for _, pid in item.save_at])
        if items[0].resume_from is None or not is_prefix_missing(e):
            raise
        prefix.missing()  # type: ignore[union-attr]
        await release(req.session_id, None, 0)  # stages that did resume hold a partial session
        return None
    finally:
        if items[0].resume_from is not None:
            prefix.resumed_done()  # type: ignore[union-attr]
    report.at(len(req.prompt_ids))
    return dataclasses.replace(outs[-1], features=_joined(outs))


def _slowest(report: _PrefillReport, items: list[SeqInput]) -> list[Callable[[float], None]]:
    """Each forward's progress listener, reporting the first forward not yet through (forwards in flight at once)."""
    done = [0.0] * len(items)

    def heard(k: int, fraction: float) -> None:
        done[k] = fraction
        first = next((i for i, f in enumerate(done) if f < 1.0), len(items) - 1)
        report.at(items[first].cache_len, done[first])

    return [lambda fraction, k=k: heard(k, fraction) for k in range(len(items))]


def _joined(outputs: list[SeqOutput]) -> Features:
    """The features of a prompt's chunks, rows in order."""
    layers = {layer for o in outputs for layer in o.features}
    return {layer: torch.cat([o.features[layer] for o in outputs if layer in o.features]) for layer in layers}


async def _first_step(forward: Forward, release: Release, req: Request, item: SeqInput) -> SeqOutput:
    """The first forward after the prompt. A prompt resumed whole starts its session here, from the kept
    prefix; a stage that no longer holds it: the prompt is prefilled after all (its kept logits gave the
    token being fed, which a prefill's would give too), then the token is fed."""
    prefix = req.prefix
    if prefix is None or prefix.logits is None:
        return await forward(item)
    assert prefix.resumed is not None
    try:
        return await forward(dataclasses.replace(item, resume_from=prefix.resumed.prefix_id))
    except Exception as e:
        if not is_prefix_missing(e):
            raise
        prefix.missing()
        await release(req.session_id, None, 0)
        await _prefill(forward, release, req)
        return await forward(item)
    finally:
        prefix.resumed_done()


class _PrefillReport:
    """A request's prefill from `start` in the fewest forwards of at most `step` tokens, of equal length (the plan
    prices them so: plan/timing/predict.py forward_lengths), where each ends (`ends`), and its progress: tokens and
    expected bytes."""

    def __init__(self, req: Request, start: int, step: int):
        self.req, self.start, self.length = req, start, len(req.prompt_ids)
        cost = req.forward_bytes or float
        self.ends = list(itertools.accumulate(forward_lengths(self.length - start, step), initial=start))[1:]
        self.bytes = [cost(end - p) for p, end in zip([start, *self.ends], self.ends, strict=False)]
        self.total = sum(self.bytes)
        self.at(start)

    def end_after(self, pos: int) -> int:
        """Where the forward from `pos` ends."""
        return next(end for end in self.ends if end > pos)

    def at(self, pos: int, fraction: float = 0.0) -> None:
        """`pos` tokens in the caches, and `fraction` of the next forward's layers done."""
        if self.req.progress is None:
            return
        k = sum(end <= pos for end in self.ends)  # forwards done
        done = sum(self.bytes[:k]) + (fraction * self.bytes[k] if k < len(self.bytes) else 0.0)
        tokens = pos + fraction * (self.end_after(pos) - pos) if pos < self.length else pos
        self.req.progress(PrefillProgress(tokens, self.length, done, self.total))

    def within(self, pos: int, end: int) -> Callable[[float], None]:
        return lambda fraction: self.at(pos, fraction)
