"""The worker's servicer: malformed forwards get INVALID_ARGUMENT and the worker keeps serving; assignments
are checked; a cancelled Assign closes what it loaded."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import fingerprint, open_checkpoint, scan_checkpoint
from deltafin.errors import SessionOutOfSync
from deltafin.models.moe import expert_outputs
from deltafin.plan.cluster.expert_placement import ExpertPlacement, ExpertRanges, Holder
from deltafin.plan.memory.holder_sizing import size_holder
from deltafin.plan.memory.sizing import Placement, SizingInput
from deltafin.runtime import wide
from deltafin.runtime.stage import Stage
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import AssignmentOptions, StageOptions
from deltafin.runtime.wide import ExpertCall
from deltafin.transport import codec, forward_parts
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.transport.generated import deltafin_pb2_grpc as pb_grpc
from deltafin.transport.worker_info import WorkerDescription, layer_ranges
from deltafin.weights.reader import layer_spans
from deltafin.weights.resident import ResidentExperts
from deltafin.worker.assignment import AssignmentSlot
from deltafin.worker.forwards import Forwards
from deltafin.worker.service import WorkerService, create_server


@pytest.fixture
def served(tiny_dir):
    """An in-process worker serving the last layers of `tiny` (a middle/last stage takes residual states)."""
    cfg = load_config(tiny_dir)
    ckpt = scan_checkpoint(tiny_dir, cfg)
    desc = WorkerDescription("t", "", "cpu", 10**9, 1.0, fingerprint(tiny_dir), layer_ranges(ckpt.layers_available()),
                             True)

    @contextlib.asynccontextmanager
    async def serving():
        """The servicer on a loopback port, stopped whatever the test does (a gRPC server left to the garbage
        collector after its event loop closed hangs the interpreter's exit)."""
        service = WorkerService(ckpt, desc, torch.device("cpu"), StageOptions())
        server, port = await create_server(service, "127.0.0.1", 0)
        try:
            yield service, port
        finally:
            await server.stop(0)
            service.close()

    return serving, cfg


async def _assign(stub, tiny_dir, start, end):
    options = codec.encode_stage_options(AssignmentOptions(dtype="fp32"))
    async for _ in stub.Assign(pb.Assignment(start=start, end=end, model_fingerprint=fingerprint(tiny_dir),
                                             options=options), timeout=60):
        pass


def test_malformed_forwards_get_invalid_argument_and_the_worker_keeps_serving(served, tiny_dir):
    serving, cfg = served
    d = cfg.hidden_size
    n = cfg.blocks_entering(3)

    def seq(**kw) -> pb.SequenceInput:
        return pb.SequenceInput(session_id="s", cache_len=0, **kw)

    def f32(*shape, nbytes=None) -> pb.Tensor:
        size = 4 * int(torch.tensor(shape).prod()) if nbytes is None else nbytes
        return pb.Tensor(dtype="float32", shape=list(shape), data=b"\0" * size)

    cases = [
        ("no input", seq(), "exactly one of ids"),
        ("ids and state", seq(ids=pb.Tensor(dtype="int64", shape=[1], data=b"\0" * 8), p=f32(1, d), b=f32(1, n, d)),
         "exactly one of ids"),
        ("wrong width", seq(p=f32(1, d + 1), b=f32(1, n, d + 1)), "P [T, 64]"),
        ("wrong block count", seq(p=f32(1, d), b=f32(1, n + 1, d)), f"B [T, {n}, 64]"),
        ("wrong size", seq(p=f32(1, d, nbytes=3), b=f32(1, n, d)), "bytes of data"),
        ("bad dtype", seq(p=pb.Tensor(dtype="complex64", shape=[1, d], data=b""), b=f32(1, n, d)), "unknown dtype"),
        ("empty session", pb.SequenceInput(session_id="", p=f32(1, d), b=f32(1, n, d)), "empty session id"),
    ]

    async def run():
        async with serving() as (service, port), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.WorkerStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:  # nothing assigned yet
                await stub.Forward(pb.ForwardRequest(sequences=[seq(p=f32(1, d), b=f32(1, n, d))]), timeout=10)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            await _assign(stub, tiny_dir, 3, 6)
            for name, s, message in cases:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Forward(pb.ForwardRequest(sequences=[s]), timeout=10)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                assert message in e.value.details(), (name, e.value.details())
            with pytest.raises(grpc.aio.AioRpcError) as e:  # an unknown session
                await stub.Forward(pb.ForwardRequest(sequences=[pb.SequenceInput(session_id="x", cache_len=5,
                                                                                  p=f32(1, d), b=f32(1, n, d))]),
                                   timeout=10)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            ok = await stub.Forward(pb.ForwardRequest(sequences=[seq(p=f32(2, d), b=f32(2, n, d))]), timeout=30)
            assert ok.sequences[0].logits.shape == [1, cfg.vocab_size]
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stats = codec.decode_stats((await stub.Stats(pb.StatsRequest(), timeout=5)).stats)
            assert stats.state == "ready" and stats.layers == (3, 6) and stats.sessions == 1
            released = await stub.Release(pb.ReleaseRequest(session_ids=["s", "nope"]), timeout=5)
            assert released.released == 1

    asyncio.run(run())


def test_assignment_is_checked(served, tiny_dir):
    serving, _ = served

    async def run():
        async with serving() as (service, port), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.WorkerStub(ch)
            for assignment, code, message in [
                (pb.Assignment(start=0, end=6, model_fingerprint="0" * 16), grpc.StatusCode.FAILED_PRECONDITION,
                 "both must use the same model files"),
                (pb.Assignment(start=0, end=6, model_fingerprint=fingerprint(tiny_dir),
                               options=pb.StageOptions(dtype="fp64")), grpc.StatusCode.INVALID_ARGUMENT,
                 "--dtype: invalid choice: 'fp64'"),
                (pb.Assignment(start=0, end=6, model_fingerprint=fingerprint(tiny_dir),
                               plan=pb.StagePlan(start=0, end=6)), grpc.StatusCode.INVALID_ARGUMENT,
                 "plan: missing device, spine"),
                (pb.Assignment(start=4, end=9, model_fingerprint=fingerprint(tiny_dir)),
                 grpc.StatusCode.FAILED_PRECONDITION, "not all on this worker's disk"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Assign(assignment, timeout=10):
                        pass
                assert e.value.code() == code and message in e.value.details()
            info = await stub.Info(pb.InfoRequest(), timeout=5)
            assert info.state == "idle"

    asyncio.run(run())


def test_a_cancelled_assign_closes_what_it_loaded(served, tiny_dir, monkeypatch):
    """The coordinator gives up on an Assign (deadline) while the stage loads: the worker closes that stage
    once its load ends, before the next Assign loads another (never two stages in memory), and serves the
    next assignment."""
    serving, cfg = served
    events: list[str] = []
    load = AssignmentSlot.load

    def slow_load(self, old, a, b, options, sizing, plan, peers, progress):
        events.append(f"load {a}-{b}")
        time.sleep(1.5)
        loaded = load(self, old, a, b, options, sizing, plan, peers, progress)
        events.append(f"loaded {a}-{b}")
        return loaded

    close = Stage.close

    def recorded_close(self):
        events.append(f"close {self.start}-{self.end}")
        close(self)

    monkeypatch.setattr(AssignmentSlot, "load", slow_load)
    monkeypatch.setattr(Stage, "close", recorded_close)

    async def run():
        async with serving() as (service, port), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.WorkerStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                options = codec.encode_stage_options(AssignmentOptions())
                async for _ in stub.Assign(pb.Assignment(start=0, end=3, model_fingerprint=fingerprint(tiny_dir),
                                                         options=options), timeout=0.5):
                    pass
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(0.2)
            assert service.state == "idle" and service.stage is None
            await _assign(stub, tiny_dir, 3, 6)
            info = await stub.Info(pb.InfoRequest(), timeout=5)
        return info

    info = asyncio.run(run())
    assert events[:4] == ["load 0-3", "loaded 0-3", "close 0-3", "load 3-6"]
    assert (info.assigned.start, info.assigned.end, info.state) == (3, 6, "ready")


def test_an_expert_holder_serves_calls_and_refuses_what_it_cannot_compute(served, tiny_dir):
    """A worker assigned no layers of a wide plan serves its experts: a call's answer is each row's weighted sum of
    its pairs' expert outputs (each as the one-process loop computes it), hints are taken at once, and calls it
    cannot compute get a status that says why."""
    part_bytes = wide.SUMS_PART_BYTES
    serving, cfg = served

    async def run():
        options = codec.encode_stage_options(AssignmentOptions(dtype="fp32"))
        # the holder's plan, as a coordinator makes it: half of every MoE layer's experts, a cache of 1 MB
        sizing = SizingInput(expert_layers=len(cfg.moe_layers), expert_share=0.5,
                               spans=layer_spans(scan_checkpoint(tiny_dir, cfg)))
        holder_plan = codec.encode_stage_plan(size_holder(cfg, Placement("cpu"), 10**6, sizing))
        g = torch.Generator().manual_seed(1)
        call = ExpertCall(cfg.moe_layers[1], torch.randn(3, cfg.expert_dim, generator=g), torch.tensor([0, 1, 2, 2]),
                          torch.tensor([4, 1, 4, 6]), torch.tensor([0.5, 2.0, 0.25, 1.0]))  # all in this worker's half

        def plan_of(*holders: Holder) -> pb.ExpertPlacement:
            placement = ExpertRanges.build([h.key for h in holders], cfg.moe_layers, cfg.num_experts,
                                              lambda i, _: 1.0)
            return codec.encode_expert_placement(ExpertPlacement(placement, holders))

        async with serving() as (service, port), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            me, other = Holder(service.description.key, f"127.0.0.1:{port}", "t"), Holder("other", "127.0.0.1:9")
            stub = pb_grpc.WorkerStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _parts(stub.RunExperts(codec.encode_expert_call(call), timeout=10))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "serves no experts" in e.value.details()
            holder_only = {"start": 0, "end": 0, "model_fingerprint": fingerprint(tiny_dir), "options": options,
                           "plan": holder_plan}
            for bad, code, words in [
                (pb.Assignment(start=0, end=0, model_fingerprint=fingerprint(tiny_dir)),
                 grpc.StatusCode.FAILED_PRECONDITION, "only an expert holder of a wide plan"),
                (pb.Assignment(**holder_only, experts=plan_of(me)), grpc.StatusCode.INVALID_ARGUMENT,
                 "two holders or more"),
                (pb.Assignment(**holder_only, experts=plan_of(other, Holder("another", "127.0.0.1:10"))),
                 grpc.StatusCode.FAILED_PRECONDITION, "does not name this worker")]:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Assign(bad, timeout=30):
                        pass
                assert e.value.code() == code and words in e.value.details(), words
            async for _ in stub.Assign(pb.Assignment(**holder_only, experts=plan_of(me, other)), timeout=60):
                pass
            assert (await stub.Info(pb.InfoRequest(), timeout=5)).state == "ready"
            whole = await _parts(stub.RunExperts(codec.encode_expert_call(call), timeout=30))
            assert len(whole) == 1  # a call whose sums fit one part answers in one
            wide.SUMS_PART_BYTES = cfg.expert_dim * 4  # a row a part: the sums go as their rows are done
            try:
                parts = await _parts(stub.RunExperts(codec.encode_expert_call(call), timeout=30))
            finally:
                wide.SUMS_PART_BYTES = part_bytes
            rows = torch.cat([codec.decode_tensor(p.rows, "rows") for p in parts])
            assert len(parts) == 3 and sorted(rows.tolist()) == [0, 1, 2]  # each row once, as its last pair was done
            got = torch.empty(3, cfg.expert_dim)
            for p in parts:
                got[codec.decode_tensor(p.rows, "rows")] = codec.decode_tensor(p.outputs, "sums")
            assert torch.equal(got, codec.decode_tensor(whole[0].outputs, "sums"))
            dense = dataclasses.replace(call, layer=0)  # layer 0 has no experts to hold
            outside = dataclasses.replace(call, rows=torch.tensor([0, 1, 1, 5]))  # row 5 of 3
            for bad_call, code in [(dense, grpc.StatusCode.FAILED_PRECONDITION),
                                   (outside, grpc.StatusCode.INVALID_ARGUMENT)]:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await _parts(stub.RunExperts(codec.encode_expert_call(bad_call), timeout=10))
                assert e.value.code() == code
            stats = codec.decode_stats((await stub.Stats(pb.StatsRequest(), timeout=5)).stats)
            assert stats.layers == (0, 0) and stats.wide is not None and stats.wide.calls_served == 2
            assert stats.wide.others_expert_bytes == 3 * cfg.bytes_per_expert  # experts 1, 4, 6
            assert await _parts(stub.RunExperts(codec.encode_expert_call(None, ((cfg.moe_layers[0], (1, 2)),)),
                                                timeout=5)) == []  # hints: answered at once, read behind
        ckpt = open_checkpoint(tiny_dir, cfg)
        resident = ResidentExperts(ckpt, cfg.moe_layers, torch.device("cpu"))
        pairs = expert_outputs(cfg, call.layer, call.z, call.rows, call.experts, resident.experts)
        want = torch.stack([pairs[0] * 0.5, pairs[1] * 2.0, pairs[2] * 0.25 + pairs[3] * 1.0])
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)

    asyncio.run(run())


async def _parts(call) -> list:
    return [part async for part in call]


def test_a_forward_in_parts_that_outgrows_the_stage_is_refused_and_one_within_it_runs(served, tiny_dir):
    """ForwardParts: parts joined into one forward give what Forward gives; a stream of parts larger than the
    stage's largest forward could carry is refused (RESOURCE_EXHAUSTED), its parts past the cap dropped as they
    arrive."""
    serving, cfg = served
    d, n = cfg.hidden_size, cfg.blocks_entering(3)

    def part(session: str, tokens: int, value: float) -> pb.ForwardRequest:
        state = torch.full((tokens, d), value), torch.full((tokens, n, d), value)
        return pb.ForwardRequest(request_id="r", sequences=[pb.SequenceInput(
            session_id=session, cache_len=0, p=codec.encode_tensor(state[0]), b=codec.encode_tensor(state[1]))])

    async def run():
        async with serving() as (service, port), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.WorkerStub(ch)
            await _assign(stub, tiny_dir, 3, 6)
            whole = await stub.Forward(pb.ForwardRequest(sequences=part("a", 6, 0.1).sequences), timeout=30)
            joined = [r async for r in stub.ForwardParts(iter([part("b", 2, 0.1), part("b", 4, 0.1)]), timeout=30)]
            assert codec.decode_tensor(joined[0].sequences[0].logits, "l").equal(
                codec.decode_tensor(whole.sequences[0].logits, "l"))
            limit = service.stage.max_forward_tokens or service.stage.plan.forward_tokens
            flood = (part("c", 512, 0.1) for _ in range(2 * limit // 512 + 8))  # twice the cap, and a megabyte
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.ForwardParts(flood, timeout=60):
                    pass
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "send it in chunks" in e.value.details()

    asyncio.run(run())


def test_a_stage_ending_on_a_dense_layer_sends_a_prompt_s_states_while_it_computes(served, tiny_dir, monkeypatch):
    """Stage [0, 1) (a dense layer) on a 300-token prompt: the caller has the first rows while the stage still
    computes (the stage holds after its first piece until the caller has them: without early parts it would wait
    in vain), the parts join in order to what the same stage computes in one process, and that is the unstreamed
    forward's to rounding (the layer ran in other pieces)."""
    serving, cfg = served
    ids = (torch.arange(300) * 7 % cfg.vocab_size).long()
    received, held = threading.Event(), []
    forward = Forwards.run

    async def holding(self, batch, all_logits, rid, early=None):
        def first_then_wait(outs):
            early(outs)
            if not held:
                held.append(received.wait(timeout=20))
        return await forward(self, batch, all_logits, rid, first_then_wait if early is not None else None)

    monkeypatch.setattr(Forwards, "run", holding)

    async def run():
        async with serving() as (service, port), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.WorkerStub(ch)
            await _assign(stub, tiny_dir, 0, 1)
            request = forward_parts.encode_request_parts([SeqInput("p", 0, ids=ids)], False, "r", 1 << 20)
            parts = []
            async for part in stub.ForwardParts(iter(request), timeout=60):
                parts.append(part)
                received.set()
            return parts

    parts = asyncio.run(run())
    assert held == [True] and len(parts) > 1
    (out,) = forward_parts.decode_output_parts(parts)
    stage = Stage(open_checkpoint(tiny_dir, load_config(tiny_dir)), 0, 1, device=torch.device("cpu"))
    try:
        streamed = stage.forward([SeqInput("s", 0, ids=ids)], early=lambda _: None)[0].state
        whole = stage.forward([SeqInput("w", 0, ids=ids)])[0].state
    finally:
        stage.close()
    assert torch.equal(out.state.P, streamed.P) and torch.equal(out.state.B, streamed.B)
    assert torch.allclose(out.state.P, whole.P, rtol=1e-5, atol=1e-6) and torch.equal(out.state.B, whole.B)


def test_a_streamed_forward_that_fails_after_its_first_piece_changes_no_session(tiny_dir):
    """A session holds 10 tokens; the first piece of stage [0, 1)'s next 300 has gone (`early` heard it), then the
    forward fails: the session is as before it (its attention state too), so the retry gives what an undisturbed
    session gives."""
    ids = (torch.arange(310) * 7 % 1000).long()
    stage = Stage(open_checkpoint(tiny_dir, load_config(tiny_dir)), 0, 1, device=torch.device("cpu"))
    heard = []

    def fail_after_first(outs):
        heard.append(outs)
        raise RuntimeError("the link went down")

    try:
        for sid in ("s", "c"):
            stage.forward([SeqInput(sid, 0, ids=ids[:10])])
        with pytest.raises(RuntimeError, match="the link went down"):
            stage.forward([SeqInput("s", 10, ids=ids[10:])], early=fail_after_first)
        assert len(heard) == 1 and heard[0][0].state.P.shape[0] == 256
        with pytest.raises(SessionOutOfSync, match="holds 10 tokens"):
            stage.forward([SeqInput("s", 310, ids=ids[:1])])
        retry = stage.forward([SeqInput("s", 10, ids=ids[10:])], early=lambda _: None)[0].state
        clean = stage.forward([SeqInput("c", 10, ids=ids[10:])], early=lambda _: None)[0].state
        assert torch.equal(retry.P, clean.P) and torch.equal(retry.B, clean.B)
    finally:
        stage.close()
