"""Stage to stage hand-offs (worker/handoff.py): what a receiving worker keeps and for how long, and, over two worker
processes, a forward whose hop goes directly answers what the relayed one and one process answer, bit for bit; a
hand-off that cannot reach the next stage falls back to the relay; a stage that fails after receiving is retried
from what it kept; a pipelined prompt hands each forward over."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from deltafin.coordinator.cluster.backend import Resume
from deltafin.coordinator.cluster.pipelined import forward_pipelined
from deltafin.coordinator.cluster.recovery import connect_cluster
from deltafin.coordinator.cluster.workers import ClusterSpec
from deltafin.errors import RemoteError, StatesGone
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.worker.handoff import Inbox
from tests.support.cluster import workers

PROMPT = torch.tensor([3, 9, 27, 81, 243, 5, 25, 125, 7, 49, 11, 121])


def _parts(rid: str, nbytes: int) -> list[pb.ForwardRequest]:
    return [pb.ForwardRequest(request_id=rid, part_bytes=1, sequences=[pb.SequenceInput(session_id="x" * nbytes)])]


def test_the_inbox_keeps_a_hand_off_until_its_forward_ran_within_its_bounds():
    inbox = Inbox(most=2, keep_seconds=60.0)
    inbox.put(_parts("a", 100), cap=10_000)
    assert inbox.take("a")[0].request_id == "a" and inbox.take("a")  # kept: a failed forward may be retried
    inbox.done("a")
    with pytest.raises(StatesGone, match="not here"):
        inbox.take("a")
    for rid in "bcd":  # at most two: the oldest goes first
        inbox.put(_parts(rid, 100), cap=10_000)
    assert [r for r in "bcd" if _held(inbox, r)] == ["c", "d"]
    inbox.put(_parts("e", 900), cap=1_000)  # over the bytes cap: older ones go, the newest stays
    assert [r for r in "cde" if _held(inbox, r)] == ["e"]
    stale = Inbox(keep_seconds=0.0)
    stale.put(_parts("old", 10), cap=10_000)
    stale.put(_parts("new", 10), cap=10_000)  # one not claimed in time is dropped
    assert not _held(stale, "old") and _held(stale, "new")


def _held(inbox: Inbox, rid: str) -> bool:
    try:
        inbox.take(rid)
        return True
    except StatesGone:
        return False


def test_a_direct_hop_answers_what_the_relay_and_one_process_answer(small_dir):
    pipe = LocalPipeline.load(small_dir, 1, device="cpu")
    try:
        want = pipe.forward([SeqInput("one", 0, ids=PROMPT)])[0].logits
        chunks = [pipe.forward([SeqInput("three", n, ids=PROMPT[n:n + 4])])[0].logits for n in (0, 4, 8)]
    finally:
        pipe.close()
    with workers(small_dir, 2) as procs:
        spec = ClusterSpec(small_dir, addresses=[p.address for p in procs], discover=False, experts="local")
        got = asyncio.run(_direct_and_relayed(spec))
    for name in ("relayed", "direct", "fallback", "retried"):
        assert torch.equal(got[name], want), name  # fp32 states, the same arithmetic: bit for bit
    assert got["answered"] == {"direct": [None], "fallback": ["state"], "retried": [None],  # stage 0 ran once
                               "pipelined": [None] * 3}
    assert got["gone"] == "NOT_FOUND"
    for mine, one in zip(got["pipelined"], chunks, strict=True):
        assert torch.equal(mine, one)
    assert got["pipelined_handed"] == 3


async def _direct_and_relayed(spec: ClusterSpec) -> dict:
    cluster, plan = await connect_cluster(spec, show_progress=False)
    backend = cluster.backend
    assert len(plan.stages) == 2
    first, second = backend.stages
    answered: dict[str, list] = {}
    got: dict = {}
    forward = first.forward

    async def watched(*args, **kwargs):  # what stage 0 answers: states, or handed over (None)
        outs = await forward(*args, **kwargs)
        answered.setdefault(watched.name, []).extend("state" if o.state is not None else None for o in outs)
        return outs

    first.forward = watched
    try:
        for name, hand in [("relayed", ["", ""]), ("direct", [second.address, ""]),
                           ("fallback", ["127.0.0.1:9", ""])]:  # nobody listens there: the states come back here
            watched.name = name
            backend.hand_to = lambda tokens, hand=hand: hand
            got[name] = (await backend.forward([SeqInput(name, 0, ids=PROMPT)]))[0].logits
        answered.pop("relayed")
        watched.name = "retried"
        backend.hand_to = lambda tokens: [second.address, ""]
        got["retried"] = await _lost_after_the_hand_off(backend, second)
        with pytest.raises(RemoteError) as e:  # a hand-off it never had
            await second.forward([SeqInput("never", 0, ids=PROMPT)], False, "r", handed_from="nobody")
        got["gone"] = e.value.code.name
        handed = 0
        stage_forward = second.forward

        async def counted(*args, **kwargs):
            nonlocal handed
            handed += bool(kwargs.get("handed_from"))
            return await stage_forward(*args, **kwargs)

        second.forward = counted
        watched.name = "pipelined"
        outs = await forward_pipelined(backend, [SeqInput("three", n, ids=PROMPT[n:n + 4]) for n in (0, 4, 8)])
        got["pipelined"], got["pipelined_handed"] = [o.logits for o in outs], handed
        got["answered"] = answered
        return got
    finally:
        await cluster.close()


async def _lost_after_the_hand_off(backend, second) -> torch.Tensor:
    """Stage 1's call fails (its link dropped) after stage 0 handed it the states: the forward resumes at stage 1
    with what its worker kept, without stage 0 again."""
    real = second.forward

    async def dropped(*args, **kwargs):
        second.forward = real
        raise RemoteError(second.name, grpc.StatusCode.UNAVAILABLE, "the link dropped")

    second.forward = dropped
    batch = [SeqInput("retried", 0, ids=PROMPT)]
    with pytest.raises(RemoteError) as e:
        await backend.forward(batch)
    at: Resume = e.value.resume_at
    assert at.stage == 1 and at.handed
    return (await backend.forward(batch, resume=at))[0].logits
