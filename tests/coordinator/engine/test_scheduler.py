"""The scheduler as a pure async component over a scripted backend: what goes in a batch, how many batches
are in flight, and a failing batcher that fails its requests instead of leaving them waiting."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deltafin.coordinator.engine.scheduler import Scheduler
from deltafin.errors import DeltafinError
from deltafin.runtime.stage_io import SeqInput, SeqOutput


class Recording:
    """A backend of `stages` stages that records each batch and holds it `delay` seconds."""

    def __init__(self, stages: int = 1, limit: int | None = None, delay: float = 0.01):
        self.parallel_stages = stages
        self.max_forward_tokens = limit
        self.delay = delay
        self.batches: list[list[int]] = []  # tokens of each sequence, per batch
        self.in_flight = self.most_in_flight = 0

    async def forward(self, batch: list[SeqInput], all_logits: bool = False, progress=None) -> list[SeqOutput]:
        self.batches.append([b.num_tokens for b in batch])
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        return [SeqOutput(b.session_id, logits=torch.zeros(1, 4)) for b in batch]

    async def release(self, session_ids: list[str], keep_as: list[str] | None = None, keep_lengths=None) -> None:
        pass


def _seq(sid: str, tokens: int) -> SeqInput:
    return SeqInput(sid, 0, ids=torch.zeros(tokens, dtype=torch.long))


async def test_decode_steps_ride_with_one_prompt_chunk_within_the_token_limit():
    backend = Recording(limit=512, delay=0.05)
    sched = Scheduler(backend, max_active=8)
    first = asyncio.create_task(sched.forward(_seq("warm", 1)))  # occupies the batcher while the rest queue
    await asyncio.sleep(0.01)
    others = [asyncio.create_task(sched.forward(_seq(s, n))) for s, n in
              (("p1", 512), ("d1", 1), ("p2", 300), ("d2", 1), ("d3", 1))]
    await asyncio.gather(first, *others)
    await sched.close()
    # after the first: the 512-token chunk cannot sit beside the three decode steps, so it goes alone (the
    # engine's chunks leave room for them); then the decode steps ride with the next chunk
    assert backend.batches[0] == [1]
    assert backend.batches[1] == [512] and backend.batches[2] == [1, 1, 1, 300]


async def test_prompts_prefilling_together_share_a_forward_within_the_token_limit():
    """Chunks of prompts that arrive together go in one forward as far as the tokens allow (each expert is then
    read once for all of them: tests/deltafin/runtime/test_pipeline.py), in arrival order, the decode steps first."""
    backend = Recording(limit=1000, delay=0.05)
    sched = Scheduler(backend, max_active=8)
    first = asyncio.create_task(sched.forward(_seq("warm", 1)))
    await asyncio.sleep(0.01)
    others = [asyncio.create_task(sched.forward(_seq(s, n))) for s, n in
              (("a", 400), ("b", 700), ("c", 300), ("d1", 1), ("e", 200))]
    await asyncio.gather(first, *others)
    await sched.close()
    assert backend.batches == [[1], [1, 400, 300, 200], [700]]


async def test_one_batch_per_stage_in_flight():
    backend = Recording(stages=3, delay=0.05)
    sched = Scheduler(backend, max_active=6)  # depth 0: one per stage
    assert sched.pipeline_depth == 3

    async def request(sid: str) -> None:
        async with sched.slot():
            for _ in range(4):
                await sched.forward(_seq(sid, 1))

    await asyncio.gather(*(request(f"r{i}") for i in range(6)))
    await sched.close()
    assert backend.most_in_flight == 3 and sched.stats.max_in_flight == 3
    assert max(len(b) for b in backend.batches) <= 2  # six streams over three batches in flight


async def test_a_failing_batcher_fails_its_requests_and_the_next_one_works(monkeypatch):
    backend = Recording()
    sched = Scheduler(backend)
    calls = {"n": 0}
    real = sched._next_batch

    def broken(pending):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug in batching")
        return real(pending)

    monkeypatch.setattr(sched, "_next_batch", broken)
    with pytest.raises(DeltafinError, match="internal error in the batcher: a bug in batching"):
        await asyncio.wait_for(sched.forward(_seq("a", 1)), timeout=5)
    out = await asyncio.wait_for(sched.forward(_seq("b", 1)), timeout=5)  # a new batcher serves it
    assert out.session_id == "b"
    await sched.close()


async def test_a_backend_error_fails_only_its_batch():
    class Failing(Recording):
        async def forward(self, batch, all_logits=False, progress=None):
            if any(b.session_id == "bad" for b in batch):
                raise DeltafinError("stage exploded")
            return await super().forward(batch, all_logits)

    sched = Scheduler(Failing())
    with pytest.raises(DeltafinError, match="stage exploded"):
        await sched.forward(_seq("bad", 1))
    assert (await sched.forward(_seq("good", 1))).session_id == "good"
    await sched.close()


async def test_a_session_is_released_only_after_the_batch_carrying_it_comes_back():
    """A request that goes away mid-step (its future cancelled, its generator releasing the session) must not
    free the state a batch in flight still uses: on a worker that fails the whole batch, the other request's
    step too (the soak's rare 503s)."""
    events: list[str] = []
    gate = asyncio.Event()

    class Gated(Recording):
        async def forward(self, batch, all_logits=False, progress=None):
            events.append("forward " + ",".join(b.session_id for b in batch))
            await gate.wait()
            events.append("forward done")
            return [SeqOutput(b.session_id, logits=torch.zeros(1, 4)) for b in batch]

        async def release(self, session_ids, keep_as=None, keep_lengths=None):
            events.append("release " + ",".join(session_ids))

    sched = Scheduler(Gated(), max_active=4)
    leaving = asyncio.create_task(sched.forward(_seq("leaving", 1)))
    staying = asyncio.create_task(sched.forward(_seq("staying", 1)))
    await asyncio.sleep(0.01)
    assert events == ["forward leaving,staying"]
    leaving.cancel()  # the client went away
    release = asyncio.create_task(sched.release("leaving"))
    other = asyncio.create_task(sched.release("idle"))  # a session no batch carries goes at once
    await asyncio.sleep(0.01)
    assert events == ["forward leaving,staying", "release idle"]
    release.cancel()  # the releasing task is cancelled too: the release still happens, after the batch
    gate.set()
    assert (await staying).session_id == "staying"
    await asyncio.sleep(0.01)
    await other
    assert events[2:] == ["forward done", "release leaving"]
    await sched.close()


async def test_separate_prefill_batches_take_turns_with_the_decode_steps():
    backend = Recording(limit=512, delay=0.02)
    sched = Scheduler(backend, max_active=4, ride=False)

    async def stream(sid: str) -> None:
        for _ in range(6):
            await sched.forward(_seq(sid, 1))

    async def prompt() -> None:
        await asyncio.sleep(0.005)  # the streams are running when it arrives
        for _ in range(3):
            await sched.forward(_seq("p", 200))

    await asyncio.gather(stream("a"), stream("b"), prompt())
    await sched.close()
    assert all(b == [200] or set(b) == {1} for b in backend.batches)  # never mixed
    chunks = [i for i, b in enumerate(backend.batches) if b == [200]]
    assert len(chunks) == 3 and all(backend.batches[i + 1] == [1, 1] for i in chunks)  # steps between chunks
