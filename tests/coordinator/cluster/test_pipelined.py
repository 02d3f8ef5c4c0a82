"""A prompt's forwards through the stages at once (coordinator/cluster/pipelined.py), against scripted stages that
check every forward comes in order and time when each ran: the answers are the ones sent one after another, the
stages overlap, and a failure says which forwards passed every stage; ResilientCluster records those, replays
and sends the rest; the scheduler pipelines only where it may."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
import torch

import deltafin
from deltafin.checkpoint.config import load_config
from deltafin.coordinator.cluster.pipelined import forward_pipelined
from deltafin.coordinator.cluster.recovery import Recovery, RecoveryOptions, ResilientCluster
from deltafin.coordinator.cluster.workers import ClusterSpec
from deltafin.coordinator.engine.scheduler import Scheduler
from deltafin.errors import RemoteError
from deltafin.models.attn_res import ResidualState
from deltafin.runtime.stage_io import SeqInput, SeqOutput
from tests.support.cluster import workers

DELAY = 0.05  # seconds a scripted stage takes a forward


class ScriptedStage:
    """Layers [start, end): a forward adds `start + 1` to every value of its input (ids as floats on the first
    stage), after DELAY; it refuses a forward that does not continue its session (as a worker does) and fails the
    calls whose number is in `fail_at`. The last stage answers the sum of its rows as logits."""

    def __init__(self, start: int, end: int, last: bool, fail_at: set[int] | None = None):
        self.start, self.end, self.last = start, end, last
        self.fail_at = fail_at or set()
        self.length: dict[str, int] = {}
        self.ran: list[tuple[int, float, float]] = []  # (cache_len, start, end) of every forward done
        self.cancelled: list[str] = []
        self.calls = 0

    async def forward(self, batch, all_logits, request_id, progress=None, relayed=None, relay=None, hand_to="",
                      handed_from=""):
        (item,) = batch
        self.calls += 1
        t0 = time.monotonic()
        if item.cache_len != self.length.get(item.session_id, 0):
            raise RemoteError(f"stage {self.start}", grpc.StatusCode.FAILED_PRECONDITION, "out of order")
        await asyncio.sleep(DELAY)
        if self.calls - 1 in self.fail_at:
            raise RemoteError(f"stage {self.start}", grpc.StatusCode.UNAVAILABLE, "gone")
        x = item.ids.float() if item.ids is not None else item.state.P[:, 0]
        y = x + self.start + 1
        self.length[item.session_id] = item.cache_len + len(y)
        self.ran.append((item.cache_len, t0, time.monotonic()))
        if progress is not None:
            progress(self.end - self.start, self.end - self.start)
        if self.last:
            return [SeqOutput(item.session_id, logits=y.sum().view(1, 1), features={self.start: y.view(-1, 1)})]
        return [SeqOutput(item.session_id, state=ResidualState(y.view(-1, 1), torch.empty(len(y), 0, 1)))]

    async def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


class ScriptedCluster:
    """What ResilientCluster and forward_pipelined use of a ClusterBackend: its stages, and a forward through them
    one after another (a replay's)."""

    max_forward_tokens = None

    def __init__(self, fail_at: set[int] | None = None):
        self.stages = [ScriptedStage(0, 2, False), ScriptedStage(2, 4, False, fail_at), ScriptedStage(4, 6, True)]
        self.workers: list = []  # the workers CurrentPlan knows by address (none here)

    async def forward(self, batch, all_logits=False, resume=None, progress=None):
        (item,) = batch
        for s in self.stages:
            (out,) = await s.forward([item], all_logits, "replay")
            item = item.carrying(out.state) if not s.last else item
        return [out]

    def hand_to(self, tokens: int) -> list[str]:
        return [""] * len(self.stages)  # every hop through the coordinator

    async def close(self) -> None:
        pass


def _items(sid: str = "p") -> list[SeqInput]:
    """A 12-token prompt in three forwards of four."""
    return [SeqInput(sid, pos, ids=torch.arange(pos, pos + 4) + 10) for pos in (0, 4, 8)]


def _expected(item: SeqInput) -> float:
    return float((item.ids.float() + 1 + 3 + 5).sum())


async def test_the_forwards_overlap_across_the_stages_and_answer_as_one_by_one() -> None:
    cluster = ScriptedCluster()
    heard: list[list[float]] = [[], [], []]
    got = await forward_pipelined(cluster, _items(), [heard[k].append for k in range(3)])  # type: ignore[arg-type]
    assert [float(o.logits) for o in got] == [_expected(i) for i in _items()]  # type: ignore[arg-type]
    assert [sorted(o.features) for o in got] == [[4]] * 3
    for s in cluster.stages:  # every stage took the forwards in order (it refuses any other)
        assert [r[0] for r in s.ran] == [0, 4, 8]
    first, second = cluster.stages[0].ran, cluster.stages[1].ran
    assert first[1][1] < second[0][2]  # stage 0 began forward 1 before stage 1 had done forward 0
    assert heard[0] == [2 / 6, 4 / 6, 1.0, 1.0] == heard[2]  # each forward's fraction of the layers, and through


async def test_a_failure_says_which_forwards_passed_every_stage() -> None:
    cluster = ScriptedCluster(fail_at={1})  # stage 1 loses forward 1
    with pytest.raises(RemoteError) as caught:
        await forward_pipelined(cluster, _items())  # type: ignore[arg-type]
    assert caught.value.done_forwards == 1  # type: ignore[attr-defined]
    assert [float(o.logits) for o in caught.value.outputs] == [_expected(_items()[0])]  # type: ignore[attr-defined]
    assert cluster.stages[2].length == {"p": 4}  # the last stage took forward 0 only
    assert cluster.stages[0].length["p"] >= 8  # stage 0 had gone on: the session needs a replay


async def test_resilient_cluster_records_what_passed_replays_and_sends_the_rest(tiny_dir: Path) -> None:
    cluster = ScriptedCluster(fail_at={1})
    rc = ResilientCluster(ClusterSpec(tiny_dir, discover=False), load_config(tiny_dir), cluster,  # type: ignore[arg-type]
                          None, RecoveryOptions(rejoin_interval=0))  # type: ignore[arg-type]
    causes: list[str] = []

    async def recover(cause: str, sessions: list[str], retry_hop: bool = False) -> Recovery:
        causes.append(cause)  # the workers came back empty (a restart): every stage forgets the session
        for s in cluster.stages:
            s.length.clear()
        return Recovery(cause, 0.0, (), True)

    rc.recover = recover  # type: ignore[method-assign]
    got = await rc.forward_pipelined(_items())
    assert len(causes) == 1 and "UNAVAILABLE" in causes[0]
    assert [float(o.logits) for o in got] == [_expected(i) for i in _items()]
    assert list(rc.journal.sessions["p"].ids) == list(range(10, 22)) and not rc.journal.stale
    assert all(s.length == {"p": 12} for s in cluster.stages)  # forward 0 replayed, then 1 and 2


class PipelinedBackend:
    max_forward_tokens = None
    parallel_stages = 3

    def __init__(self, pipelines: bool):
        self.cluster = ScriptedCluster()
        self.sent: list[str] = []
        if pipelines:
            self.forward_pipelined = self._pipelined

    async def _pipelined(self, items, progress=None):
        self.sent.append("pipelined")
        return await forward_pipelined(self.cluster, items, progress)  # type: ignore[arg-type]

    async def forward(self, batch, all_logits=False, progress=None):
        self.sent.append("one")
        return await self.cluster.forward(batch)

    async def release(self, *args, **kwargs) -> None:
        pass


async def test_the_scheduler_pipelines_a_lone_prompt_where_its_backend_can() -> None:
    backend = PipelinedBackend(True)
    scheduler = Scheduler(backend)  # type: ignore[arg-type]
    try:
        async with scheduler.slot():
            assert scheduler.pipelines(3) and not scheduler.pipelines(1)
            got = await scheduler.prompt(_items())
        assert [float(o.logits) for o in got] == [_expected(i) for i in _items()]  # type: ignore[arg-type]
        assert backend.sent == ["pipelined"] and scheduler.stats.pipelined_prompts == 1
        async with scheduler.slot(), scheduler.slot():  # another request running: its steps ride, one by one
            assert not scheduler.pipelines(3)
        assert not Scheduler(PipelinedBackend(False)).pipelines(3)  # type: ignore[arg-type]
        assert not Scheduler(backend, pipeline_depth=1).pipelines(3)  # type: ignore[arg-type]
    finally:
        await scheduler.close()


def test_a_long_prompt_through_worker_processes_answers_as_one_process(small_dir: Path) -> None:
    """Two stages on two workers, a 70-token prompt in five forwards sent at once: the greedy answer of one process
    that feeds it in the same forwards one after another."""
    prompt = [(i * 37) % 900 + 5 for i in range(70)]
    with deltafin.load(small_dir, device="cpu", progress=False, prefill_chunk=16) as m:
        want = m.generate(prompt, max_tokens=6, temperature=0.0).token_ids
    with workers(small_dir, 2) as procs, deltafin.connect(
            small_dir, [p.address for p in procs], discover=False, progress=False, experts="local", prefill_chunk=16,
            pipeline_depth=2) as m:
        got = m.generate(prompt, max_tokens=6, temperature=0.0).token_ids
        assert m.engine.scheduler.stats.pipelined_prompts == 1
    assert got == want
