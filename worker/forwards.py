"""A stage's forwards on a worker: their input parts taken within what the stage's largest forward carries, each
run on the stage's thread where a caller that goes away stops it between layers (`Forwards`), and their outputs
handed on as they are done (`as_done`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from deltafin.errors import NotAssigned, OutOfMemory
from deltafin.models.attn_res import ResidualState
from deltafin.plan.memory.stage_parts import boundary_bytes_per_token
from deltafin.runtime.stage import Stage
from deltafin.runtime.stage_io import SeqOutput
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.worker.assignment import AssignmentSlot

T = TypeVar("T")


class Forwards:
    """The forwards of the stage `slot` holds: which run (request id -> stop flag, for Cancel) and how far the one
    running is (layers done, of its stage's: what Info says); `served()` counts each as work in flight."""

    def __init__(self, slot: AssignmentSlot, served: Callable[[], contextlib.AbstractContextManager[None]]):
        self.slot, self.served = slot, served
        self.progress = (0, 0)
        self.running: dict[str, threading.Event] = {}

    def _stage(self) -> Stage:
        stage = self.slot.stage
        if stage is None:
            raise NotAssigned(f"this worker has no stage loaded (state: {self.slot.state}); assign it first")
        return stage

    async def parts(self, requests: AsyncIterator[pb.ForwardRequest]) -> list[pb.ForwardRequest]:
        """A forward's parts, refused as soon as they outgrow what the stage's largest forward carries (its hidden
        states at its first layer, an eighth more and a megabyte for the framing): the rest of the stream is read and
        dropped, so a sender cannot fill the worker's memory."""
        stage = self._stage()
        cap, tokens = self.largest(), stage.max_forward_tokens or stage.plan.forward_tokens
        msgs, size = [], 0
        async for r in requests:
            size += r.ByteSize()
            if size <= cap:
                msgs.append(r)
        if size > cap:  # read to the end, holding nothing: a status sent mid-stream reaches the sender as INTERNAL
            raise OutOfMemory(f"a forward's parts came to {size / 1e6:.0f} MB, more than this stage's largest "
                              f"forward ({tokens} tokens, {cap / 1e6:.0f} MB) carries: send it in chunks")
        return msgs

    def largest(self) -> int:
        """What the stage's largest forward's inputs take in parts: its hidden states at its first layer, an eighth
        more and a megabyte for the framing."""
        stage = self._stage()
        tokens = stage.max_forward_tokens or stage.plan.forward_tokens
        return tokens * boundary_bytes_per_token(stage.cfg, stage.start, 4) * 9 // 8 + (1 << 20)

    async def run(self, batch: list, all_logits: bool, rid: str,
                       early: Callable[[list[SeqOutput]], None] | None = None) -> list:
        """Run a forward on the stage's thread; a caller that goes away (deadline, disconnect) stops it between
        layers. `early`: Stage.forward's (on the stage's thread)."""
        stop = threading.Event()
        try:
            stage = self._stage()
            if rid:
                self.running[rid] = stop
            with self.served():
                return await self.slot.on_stage_thread(
                    lambda: stage.forward(batch, all_logits=all_logits, should_stop=stop.is_set,
                                          progress=self._heard, early=early))
        except asyncio.CancelledError:
            stop.set()
            raise
        finally:
            self.progress = (0, 0)
            if rid:
                self.running.pop(rid, None)

    def _heard(self, done: int, layers: int) -> None:  # on the stage's thread: one tuple, replaced whole
        self.progress = (done, layers)


async def as_done(run: Callable[[Callable[[list[SeqOutput]], None]], Awaitable[list[SeqOutput]]],
                   ran: Callable[[], None] | None = None) -> AsyncIterator[list[SeqOutput]]:
    """A forward's outputs as they are done: what it hands its `early` callback (from the stage's thread) at once,
    each sequence's slices in order, then the rows of its answer not sent yet (`ran` is told once it has run). A
    caller that stops reading cancels the forward (the stage stops between layers)."""
    loop = asyncio.get_running_loop()
    early: asyncio.Queue[list[SeqOutput]] = asyncio.Queue()
    forward = asyncio.ensure_future(run(lambda outs: loop.call_soon_threadsafe(early.put_nowait, outs)))
    sent: dict[str, int] = {}  # rows of each sequence already sent
    try:
        while not forward.done() or not early.empty():
            if early.empty():
                got = asyncio.ensure_future(early.get())
                await asyncio.wait({forward, got}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    continue  # the forward ended: what it handed on just before is queued, then the rest
                outs = got.result()
            else:
                outs = early.get_nowait()
            for o in outs:
                sent[o.session_id] = sent.get(o.session_id, 0) + o.state.P.shape[0]  # type: ignore[union-attr]
            yield outs
        rest = [_unsent(o, sent.get(o.session_id, 0)) for o in forward.result()]
        if ran is not None:
            ran()
    finally:
        forward.cancel()
    yield [o for o in rest if o is not None]


async def until(work: Awaitable[object], queue: asyncio.Queue[T]) -> AsyncIterator[T]:
    """What `work` puts on `queue` (from another thread, through the loop) while it runs, then what it left there;
    its failure raised after."""
    work = asyncio.ensure_future(work)
    while not work.done() or not queue.empty():
        if queue.empty():
            got = asyncio.ensure_future(queue.get())
            await asyncio.wait({work, got}, return_when=asyncio.FIRST_COMPLETED)
            if not got.done():
                got.cancel()
                continue  # the work ended: what it put just before is queued
            yield got.result()
        else:
            yield queue.get_nowait()
    work.result()


def _unsent(o: SeqOutput, sent: int) -> SeqOutput | None:
    """What of a stage's output `sent` rows of which went early (None: all of it)."""
    if sent == 0:
        return o
    assert o.state is not None
    if sent >= o.state.P.shape[0]:
        return None
    return SeqOutput(o.session_id, state=ResidualState(o.state.P[sent:], o.state.B[sent:]))
