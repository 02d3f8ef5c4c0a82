"""A hop relayed part by part (coordinator/cluster/relay.py), against scripted workers: the next stage's call has
the first part of the stage before's answer while that stage is still sending the rest, receives exactly what an
unrelayed hop carries, and a failure on either side of the hop leaves `resume_at` as before (the stage that
failed, its whole inputs)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deltafin.coordinator.cluster.backend import ClusterBackend
from deltafin.coordinator.cluster.worker_client import Timeouts, WorkerClient
from deltafin.errors import RemoteError
from deltafin.models.attn_res import ResidualState
from deltafin.runtime.stage_io import SeqInput, SeqOutput
from deltafin.transport import forward_parts

D, BLOCKS = 8, 2


class Call:
    """A streaming call: its response parts as the script produces them, and cancel()."""

    def __init__(self, responses):
        self._responses, self.cancelled = responses, False

    def __aiter__(self):
        return self._responses

    def cancel(self):
        self.cancelled = True


class Script:
    """A worker's ForwardParts: reads its request parts as they come (recording when), then answers in parts;
    `gate` holds its second part back until it is set; `fail_after`: parts sent before it fails as a lost
    worker's call does."""

    def __init__(self, name: str, last: bool, gate: asyncio.Event | None = None, fail_after: int | None = None):
        self.name, self.last, self.gate, self.fail_after = name, last, gate, fail_after
        self.received: list[str] = []  # "part" per request part taken, "end" once the stream is whole
        self.inputs: list[SeqInput] | None = None
        self.calls: list[Call] = []
        self.log: list[str] = []  # shared: the order of events across workers

    def ForwardParts(self, requests, timeout, metadata):  # the gRPC method's name
        async def responses():
            msgs = []
            async for r in (requests if hasattr(requests, "__aiter__") else _aiter(requests)):
                msgs.append(r)
                self.log.append(f"{self.name} got a part")
            self.log.append(f"{self.name} has its inputs")
            batch, all_logits, _ = forward_parts.decode_request_parts(msgs)
            self.inputs = batch
            outputs = [SeqOutput(b.session_id, logits=_tensor(b).P.sum(-1, keepdim=True)) if self.last
                       else SeqOutput(b.session_id, state=ResidualState(_tensor(b).P * 2, _tensor(b).B + 1))
                       for b in batch]
            for n, part in enumerate(forward_parts.encode_output_parts(outputs, 4 * D * 4)):  # 4 tokens a part
                if n == self.fail_after:
                    raise _lost(self.name)
                if n == 1 and self.gate is not None:
                    await self.gate.wait()
                self.log.append(f"{self.name} sent part {n}")
                yield part

        self.calls.append(Call(responses()))
        return self.calls[-1]


async def _aiter(items):
    for item in items:
        yield item


def _tensor(b: SeqInput) -> ResidualState:
    if b.state is not None:
        return b.state
    x = b.ids.float().unsqueeze(-1).expand(-1, D).contiguous()  # stage 0 "embeds" its ids
    return ResidualState(x, x.unsqueeze(1).expand(-1, BLOCKS, -1).contiguous())


def _lost(name: str) -> Exception:
    import grpc

    class Lost(grpc.aio.AioRpcError):
        def __init__(self):
            super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")

    return Lost()


async def _backend(scripts: list[Script]) -> ClusterBackend:
    clients = []
    for i, s in enumerate(scripts):
        c = WorkerClient(f"127.0.0.1:{i + 1}", s.name, timeouts=Timeouts(probe_interval=60.0))
        c.stub, c.start, c.end, c.part_bytes = s, i, i + 1, 4 * D * 4
        clients.append(c)
    return ClusterBackend(clients)


BATCH = [SeqInput("a", 0, ids=torch.arange(10)), SeqInput("b", 0, ids=torch.arange(100, 106))]


async def test_the_next_stage_has_the_first_part_while_the_one_before_still_sends():
    gate = asyncio.Event()
    scripts = [Script("s0", False, gate), Script("s1", False), Script("s2", True)]
    log: list[str] = []
    for s in scripts:
        s.log = log
    backend = await _backend(scripts)

    async def open_gate():
        while "s1 got a part" not in log:
            await asyncio.sleep(0.01)
        log.append("gate opened")
        gate.set()

    try:
        opener = asyncio.ensure_future(open_gate())
        out = await asyncio.wait_for(backend.forward(BATCH), 10)
        await opener
    finally:
        await backend.close()
    # s1's call began with s0's first part, before s0 sent its second
    assert log.index("s1 got a part") < log.index("gate opened") < log.index("s0 sent part 1")
    assert log.index("s1 has its inputs") > max(i for i, x in enumerate(log) if x.startswith("s0 sent"))
    # what each stage received is the whole hop, as route() would carry it
    x = {b.session_id: _tensor(b) for b in BATCH}
    for b in scripts[1].inputs:
        assert b.cache_len == 0 and b.ids is None
        assert torch.equal(b.state.P, x[b.session_id].P * 2) and torch.equal(b.state.B, x[b.session_id].B + 1)
    want = {sid: (s.P * 4).sum(-1, keepdim=True) for sid, s in x.items()}
    assert {o.session_id: o.logits.tolist() for o in out} == {k: v.tolist() for k, v in want.items()}


@pytest.mark.parametrize("failing", [0, 1])
async def test_a_failure_on_either_side_of_a_relayed_hop_resumes_where_it_was(failing):
    """s0 lost after its first part: s1's call (begun with that part) is cancelled, resume at (0, the batch).
    s1 lost after its first part of answer: resume at (1, s0's whole outputs as its inputs)."""
    scripts = [Script("s0", False, fail_after=1 if failing == 0 else None),
               Script("s1", False, fail_after=1 if failing == 1 else None), Script("s2", True)]
    backend = await _backend(scripts)
    try:
        with pytest.raises(RemoteError) as e:
            await asyncio.wait_for(backend.forward(BATCH), 10)
    finally:
        await backend.close()
    at, inputs = e.value.resume_at.stage, e.value.resume_at.inputs
    assert at == failing and e.value.resume_at.handed == ""
    if failing == 0:
        assert inputs is BATCH
        assert scripts[1].calls and scripts[1].calls[0].cancelled and scripts[1].inputs is None
    else:
        assert [b.session_id for b in inputs] == ["a", "b"]
        for b in inputs:
            s = _tensor(next(x for x in BATCH if x.session_id == b.session_id))
            assert torch.equal(b.state.P, s.P * 2) and torch.equal(b.state.B, s.B + 1)
    assert not scripts[2].calls or scripts[2].inputs is None  # the last stage never ran
