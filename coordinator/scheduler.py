"""Admission and batching in front of a Backend.

Requests hold one of `max_active` slots while they generate; up to `queue_depth` more wait for one, and
the rest are refused at once (`QueueFull`, HTTP 429) rather than piling up. The active requests' forwards
are merged: while one batch is in flight the next steps of the others collect, and go as one batch (a
stage reads each routed expert once for all the sequences that need it). A batch whose requests have
all gone away is cancelled on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from deltafin.errors import DeltafinError
from deltafin.stage import SeqInput, SeqOutput

from .backend import Backend, PartialFailure

log = logging.getLogger(__name__)


class QueueFull(DeltafinError):
    """Every slot is busy and the waiting queue is full."""


@dataclass
class SchedulerStats:
    active: int = 0
    waiting: int = 0
    batches: int = 0
    batched_sequences: int = 0


class Scheduler:
    def __init__(self, backend: Backend, max_active: int = 4, queue_depth: int = 16):
        if max_active < 1 or queue_depth < 0:
            raise DeltafinError("the scheduler needs at least one active slot and a queue depth >= 0")
        self.backend = backend
        self.max_active, self.queue_depth = max_active, queue_depth
        self.stats = SchedulerStats()
        self._slots = asyncio.Semaphore(max_active)
        self._pending: list[tuple[SeqInput, asyncio.Future[SeqOutput]]] = []
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

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

    async def forward(self, seq: SeqInput) -> SeqOutput:
        """One sequence's forward, sent with whatever other sequences are ready at the same time."""
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._run(), name="deltafin-batcher")
        future: asyncio.Future[SeqOutput] = asyncio.get_running_loop().create_future()
        self._pending.append((seq, future))
        self._wake.set()
        return await future

    async def release(self, session_id: str) -> None:
        try:
            await self.backend.release([session_id])
        except Exception as e:  # a worker that is gone has nothing left to free
            log.warning("could not release session %s: %s", session_id[:8], e)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._take([(s, f) for s, f in self._pending if not f.done()])
            if self._pending:
                self._wake.set()  # what did not fit this batch goes in the next
            if not batch:
                continue
            self.stats.batches += 1
            self.stats.batched_sequences += len(batch)
            call = asyncio.ensure_future(self.backend.forward([s for s, _ in batch]))
            futures = [f for _, f in batch]

            def abandon(_: asyncio.Future[SeqOutput], call: asyncio.Future = call,
                        futures: list[asyncio.Future[SeqOutput]] = futures) -> None:
                if all(f.cancelled() for f in futures):
                    call.cancel()

            for f in futures:
                f.add_done_callback(abandon)
            try:
                outputs = await asyncio.shield(call) if not call.done() else call.result()
            except asyncio.CancelledError:
                if not call.cancelled():  # this loop itself is being cancelled (shutdown)
                    call.cancel()
                    raise
                continue
            except PartialFailure as e:
                for f, result in zip(futures, e.results, strict=True):
                    if f.done():
                        continue
                    if isinstance(result, BaseException):
                        f.set_exception(result)
                    else:
                        f.set_result(result)
                continue
            except Exception as e:
                for f in futures:
                    if not f.done():
                        f.set_exception(e)
                continue
            for f, out in zip(futures, outputs, strict=True):
                if not f.done():
                    f.set_result(out)

    def _take(self, pending: list[tuple[SeqInput, asyncio.Future[SeqOutput]]]) -> tuple[list, list]:
        """The next batch, within the tokens one forward may carry (every sequence's own forward fits alone)."""
        limit = self.backend.max_forward_tokens
        if limit is None:
            return pending, []
        batch, tokens = [], 0
        for i, (s, f) in enumerate(pending):
            if batch and tokens + s.num_tokens > limit:
                return batch, pending[i:]
            batch.append((s, f))
            tokens += s.num_tokens
        return batch, []

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
