"""Admission, batching and pipelining in front of a Backend.

Requests hold one of `max_active` slots while they generate; up to `queue_depth` more wait for one, and
the rest are refused at once (`QueueFull`, HTTP 429) rather than piling up. The active requests' forwards
are merged into batches (a stage reads each routed expert once for all the sequences in one), and up to
`pipeline_depth` batches are in flight at once: with a cluster of N stages, stage 0 can work on one batch
while stage 1 works on another. A batch is the waiting decode steps plus at most one prompt chunk
(`--prefill-chunk` tokens): a running stream rides with the next chunk of another request's prompt instead
of waiting for the whole prompt, and at K3's sizes that costs it no reads (a chunk reads nearly every expert
anyway; docs/serving.md). With depth > 1 the decode steps are split into that many batches, so that they
spread over the stages instead of moving in lockstep. A batch whose requests have all gone away is
cancelled on the workers. A session is released only after every batch carrying it has come back: a
request that goes away mid-step must not free its state under a batch that still uses it (the stage would
fail the whole batch, the other requests' steps too). If the batcher itself fails, the requests waiting on
it fail with the error and the next request starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from deltafin.coordinator.cluster.backend import Backend
from deltafin.errors import DeltafinError, PartialFailure, QueueFull
from deltafin.runtime.stage_io import SeqInput, SeqOutput

log = logging.getLogger(__name__)




@dataclass
class SchedulerStats:
    active: int = 0
    waiting: int = 0
    batches: int = 0
    batched_sequences: int = 0
    prefill_batches: int = 0
    max_in_flight: int = 0  # the most batches that were in flight at once
    pipelined_prompts: int = 0  # prompts whose forwards went through the stages at once (`prompt`)


Pending = tuple[SeqInput, "asyncio.Future[SeqOutput]"]


class Scheduler:
    def __init__(self, backend: Backend, max_active: int = 4, queue_depth: int = 16, pipeline_depth: int = 0,
                 ride: bool = True):
        if max_active < 1 or queue_depth < 0 or pipeline_depth < 0:
            raise DeltafinError("the scheduler needs at least one active slot, a queue depth >= 0 and a pipeline "
                                "depth >= 0")
        self.backend = backend
        self.max_active, self.queue_depth = max_active, queue_depth
        self._depth = pipeline_depth
        self.ride = ride  # decode steps ride with a prompt chunk; False: chunks and steps take turns alone
        self._chunk_turn = False  # without riding: whether the chunk goes next, rather than the steps
        self.stats = SchedulerStats()
        self._slots = asyncio.Semaphore(max_active)
        self._pending: list[Pending] = []
        self._inflight: dict[asyncio.Task[None], frozenset[str]] = {}  # batches in flight: their sessions
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._progress: dict[int, Callable[[float], None]] = {}  # a pending forward's listener, by its future
        self._carried: dict[asyncio.Task[None], list[asyncio.Future[SeqOutput]]] = {}  # a batch's callers
        self._ended: BaseException | None = None  # `end`: every forward from now on fails with this
        self._held = 0  # prompts pipelined through the stages (`prompt`): no batch starts meanwhile

    @property
    def pipeline_depth(self) -> int:
        """Batches in flight at most: as given, or (0) one per stage that can compute at the same time as
        the others (the backend's `parallel_stages`: 1 in-process; CPU workers on one host count once)."""
        return self._depth or max(1, self.backend.parallel_stages)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold an active slot for one request (waits in the queue; QueueFull when that is full too)."""
        if self._slots.locked() and self.stats.waiting >= self.queue_depth:
            raise QueueFull(f"the server is busy: {self.stats.active} requests running and {self.stats.waiting} "
                            f"waiting (queue depth {self.queue_depth}); retry later")
        self.stats.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.stats.waiting -= 1
        self.stats.active += 1
        try:
            yield
        finally:
            self.stats.active -= 1
            self._slots.release()

    async def forward(self, seq: SeqInput, progress: Callable[[float], None] | None = None) -> SeqOutput:
        """One sequence's forward, sent with whatever other sequences are ready at the same time; `progress`
        hears how far the batch that carries it is (the fraction of the model's layers done)."""
        if self._ended is not None:
            raise self._ended
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._run(), name="deltafin-batcher")
            self._loop_task.add_done_callback(self._batcher_ended)
        future: asyncio.Future[SeqOutput] = asyncio.get_running_loop().create_future()
        if progress is not None:
            self._progress[id(future)] = progress
            future.add_done_callback(lambda f: self._progress.pop(id(f), None))
        self._pending.append((seq, future))
        self._wake.set()
        return await future

    def pipelines(self, forwards: int) -> bool:
        """Whether a prompt of `forwards` forwards goes through the stages at once (coordinator/cluster/pipelined.py):
        a backend that can, with stages that compute at the same time, and no other request running, whose decode
        steps would otherwise ride with its forwards (they wait for the prompt instead)."""
        return (forwards > 1 and hasattr(self.backend, "forward_pipelined") and self.pipeline_depth > 1
                and self.stats.active <= 1)

    async def prompt(self, items: list[SeqInput],
                     progress: list[Callable[[float], None]] | None = None) -> list[SeqOutput]:
        """One sequence's consecutive forwards through the stages at once, where `pipelines` says so, with the
        stages to themselves: batches in flight finish first, and none starts until it is done."""
        if self._ended is not None:
            raise self._ended
        self._held += 1
        try:
            if self._inflight:
                await asyncio.wait(list(self._inflight))
            task = asyncio.ensure_future(self.backend.forward_pipelined(items, progress))  # type: ignore[attr-defined]
            self._inflight[task] = frozenset({items[0].session_id})  # a release waits for it
            self._carried[task] = []  # `end` cancels it
            task.add_done_callback(self._sent)
            self.stats.batches += len(items)
            self.stats.prefill_batches += len(items)
            self.stats.pipelined_prompts += 1
            return await task
        finally:
            self._held -= 1
            self._wake.set()

    async def release(self, session_id: str, keep_as: str | None = None, keep_length: int = 0) -> None:
        """Free a session (or keep it as the prefix `keep_as`), once no batch in flight carries it; the
        release goes ahead even if the caller is cancelled meanwhile."""
        carrying = [t for t, sessions in self._inflight.items() if session_id in sessions]
        await asyncio.shield(self._release_after(carrying, session_id, keep_as, keep_length))

    async def _release_after(self, batches: list[asyncio.Task[None]], session_id: str, keep_as: str | None,
                             keep_length: int) -> None:
        if batches:
            await asyncio.wait(batches)
        try:
            await self.backend.release([session_id], [keep_as] if keep_as else None,
                                       [keep_length] if keep_as and keep_length else None)
        except Exception as e:  # a worker that is gone has nothing left to free
            log.warning("could not release session %s: %s", session_id[:8], e)

    async def release_prefixes(self, prefix_ids: list[str]) -> None:
        """Drop kept prefixes on every stage (the prefix index evicted them)."""
        try:
            await self.backend.release(prefix_ids)
        except Exception as e:
            log.warning("could not drop %d kept prefixes: %s", len(prefix_ids), e)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._pending = [(s, f) for s, f in self._pending if not f.done()]
            while self._pending and len(self._inflight) < self.pipeline_depth and not self._held:
                batch, self._pending = self._next_batch(self._pending)
                task = asyncio.create_task(self._send(batch), name="deltafin-batch")
                self._inflight[task] = frozenset(s.session_id for s, _ in batch)
                self._carried[task] = [f for _, f in batch]
                self.stats.max_in_flight = max(self.stats.max_in_flight, len(self._inflight))
                task.add_done_callback(self._sent)

    def _next_batch(self, pending: list[Pending]) -> tuple[list[Pending], list[Pending]]:
        """The decode steps (their share, when pipelining), plus the prompt chunks the tokens one forward may carry
        allow: a chunk reads nearly every expert of a layer, so the decode steps riding with it read nothing more,
        and prompts prefilling together share the reads (each expert once per forward, whatever its rows); a
        stream never waits for a prompt's batch to pass before its own. Without riding, the steps and the chunks
        take turns in batches of their own."""
        decode = [p for p in pending if _is_step(p[0])]
        if decode and self.pipeline_depth > 1:
            decode = decode[:max(1, -(-max(self.stats.active, len(decode)) // self.pipeline_depth))]
        limit = self.backend.max_forward_tokens
        if limit is not None:  # the steps that fit one forward (a speculative one carries its drafts)
            fits = list(itertools.accumulate(p[0].num_tokens for p in decode))
            decode = decode[:max(1, sum(n <= limit for n in fits))] if decode else decode
        chunks = [p for p in pending if not _is_step(p[0])]
        room = None if limit is None else limit - sum(p[0].num_tokens for p in decode)
        if not chunks:
            batch = decode
        elif not decode or (room is not None and chunks[0][0].num_tokens > room):
            batch = _together(chunks, limit)  # alone: nothing to ride with them, or no room beside them
        elif self.ride:
            batch = [*decode, *_together(chunks, room)]
        else:
            batch = _together(chunks, limit) if self._chunk_turn else decode
            self._chunk_turn = not self._chunk_turn
        taken = {id(p) for p in batch}
        return batch, [p for p in pending if id(p) not in taken]

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._inflight.pop(task, None)
        self._carried.pop(task, None)
        self._wake.set()  # room for the next batch

    def end(self, error: BaseException) -> None:
        """Fail every forward with `error`, those waiting and those in batches in flight (cancelled on the
        stages), and every one asked for from now on (a server shutting down)."""
        self._ended = error
        _fail([f for _, f in self._pending], error)
        self._pending.clear()
        for task, futures in list(self._carried.items()):
            _fail(futures, error)
            task.cancel()

    def _batcher_ended(self, task: asyncio.Task[None]) -> None:
        """The batcher never ends but by close(); if it failed, its waiting requests fail with the reason."""
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.error("the batcher failed: %s", error, exc_info=error)
        for _, f in self._pending:
            if not f.done():
                f.set_exception(DeltafinError(f"internal error in the batcher: {error}"))
        self._pending.clear()

    async def _send(self, batch: list[Pending]) -> None:
        self.stats.batches += 1
        self.stats.batched_sequences += len(batch)
        self.stats.prefill_batches += any(not _is_step(s) for s, _ in batch)
        futures = [f for _, f in batch]
        try:
            call = asyncio.ensure_future(self.backend.forward([s for s, _ in batch], **self._heard(futures)))
        except Exception as e:
            _fail(futures, e)
            return

        def abandon(_: asyncio.Future[SeqOutput]) -> None:
            if all(f.cancelled() for f in futures):
                call.cancel()

        for f in futures:
            f.add_done_callback(abandon)
        try:
            outputs = await asyncio.shield(call)
        except asyncio.CancelledError:
            if not call.cancelled():  # the scheduler itself is being closed
                call.cancel()
                raise
            return
        except PartialFailure as e:
            for f, result in zip(futures, e.results, strict=True):
                if f.done():
                    continue
                if isinstance(result, BaseException):
                    f.set_exception(result)
                else:
                    f.set_result(result)
            return
        except Exception as e:
            _fail(futures, e)
            return
        for f, out in zip(futures, outputs, strict=True):
            if not f.done():
                f.set_result(out)

    def _heard(self, futures: list[asyncio.Future[SeqOutput]]) -> dict[str, Any]:
        """The batch's progress callback, for the sequences whose caller listens (none: no keyword at all)."""
        listeners = [self._progress[id(f)] for f in futures if id(f) in self._progress]
        return {"progress": lambda fraction: [p(fraction) for p in listeners]} if listeners else {}

    async def close(self) -> None:
        tasks = [t for t in (self._loop_task, *self._inflight) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t


def _is_step(seq: SeqInput) -> bool:
    """A decode step (one token, or one with drafts to verify) rather than a prompt chunk."""
    return seq.num_tokens == 1 or seq.speculative


def _fail(futures: list[asyncio.Future[SeqOutput]], error: BaseException) -> None:
    for f in futures:
        if not f.done():
            f.set_exception(error)


def _together(chunks: list[Pending], room: int | None) -> list[Pending]:
    """The first prompt chunk, and the next ones while they fit `room` tokens with it (None: all of them)."""
    taken, used = [chunks[0]], chunks[0][0].num_tokens
    for p in chunks[1:]:
        if room is None or used + p[0].num_tokens <= room:
            taken.append(p)
            used += p[0].num_tokens
    return taken
