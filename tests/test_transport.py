"""Wire format: the generated code is current; residual states of every block count round-trip exactly;
malformed messages get INVALID_ARGUMENT from a running worker, which keeps serving."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import grpc
import pytest
import torch

from deltafin.checkpoint import fingerprint, scan_checkpoint
from deltafin.config import load_config
from deltafin.errors import CodecError
from deltafin.models.attn_res import ResidualState
from deltafin.stage import SeqInput, SeqOutput, StageOptions
from deltafin.transport import codec
from deltafin.transport.codec import WorkerDescription, layer_ranges
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.transport.generated import deltafin_pb2_grpc as pb_grpc


def test_generated_code_is_current():
    from deltafin.transport.generate import FILES, OUT, generate

    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
    for name in FILES:
        assert (OUT / name).read_text() == fresh[name], f"{name} is stale: run python -m deltafin.transport.generate"


@pytest.mark.parametrize("blocks", [0, 1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_states_round_trip_exactly(blocks, dtype):
    g = torch.Generator().manual_seed(blocks)
    state = ResidualState(torch.randn(5, 64, generator=g).to(dtype), torch.randn(5, blocks, 64, generator=g).to(dtype))
    msgs = codec.encode_inputs([SeqInput("s", 3, state=state), SeqInput("t", 0, ids=torch.tensor([1, 2, 3]))])
    wire = pb.ForwardRequest(sequences=msgs).SerializeToString()
    back = codec.decode_inputs(list(pb.ForwardRequest.FromString(wire).sequences))
    assert torch.equal(back[0].state.P, state.P) and torch.equal(back[0].state.B, state.B)
    assert back[0].state.B.dtype == dtype and back[0].cache_len == 3
    assert torch.equal(back[1].ids, torch.tensor([1, 2, 3]))
    # size per token on the wire: (1 + n) * D * dtype size, plus a few bytes of framing
    per_token = ResidualState.nbytes_per_token(blocks, 64, state.P.element_size())
    assert len(msgs[0].p.data) + len(msgs[0].b.data) == 5 * per_token
    out = codec.decode_outputs(codec.encode_outputs([SeqOutput("s", logits=torch.randn(2, 10))]))
    assert out[0].logits.shape == (2, 10)


BAD = [
    ("unknown dtype", pb.Tensor(dtype="float64", shape=[1, 64], data=b"\0" * 512), "unknown dtype"),
    ("short data", pb.Tensor(dtype="float32", shape=[2, 64], data=b"\0" * 100), "bytes of data"),
    ("absurd shape", pb.Tensor(dtype="float32", shape=[1 << 40, 1 << 20], data=b""), "absurd"),
    ("negative dim", pb.Tensor(dtype="float32", shape=[-1, 64], data=b""), "invalid shape"),
    ("rank 9", pb.Tensor(dtype="float32", shape=[1] * 9, data=b"\0" * 4), "invalid shape"),
]


@pytest.mark.parametrize("name, tensor, message", BAD, ids=[b[0] for b in BAD])
def test_codec_rejects_malformed_tensors(name, tensor, message):
    with pytest.raises(CodecError, match=message):
        codec.decode_tensor(tensor, "t")


def test_layer_ranges():
    assert layer_ranges([0, 1, 2, 5, 6, 9]) == ((0, 3), (5, 7), (9, 10))
    d = WorkerDescription("w", "", "cpu", 1, 1.0, "fp", ((0, 3), (5, 7)), True)
    assert d.has_layers(0, 3) and d.has_layers(5, 7) and not d.has_layers(2, 6)


@pytest.fixture
def served(tiny_dir):
    """An in-process worker serving the last layers of `tiny` (a middle/last stage takes residual states)."""
    from deltafin.worker.service import WorkerService, create_server

    cfg = load_config(tiny_dir)
    ckpt = scan_checkpoint(tiny_dir, cfg)
    desc = WorkerDescription("t", "", "cpu", 10**9, 1.0, fingerprint(tiny_dir), layer_ranges(ckpt.layers_available()),
                             True)

    async def start():
        service = WorkerService(ckpt, desc, torch.device("cpu"), StageOptions())
        server, port = await create_server(service, "127.0.0.1", 0)
        return service, server, port

    return start, cfg


async def _assign(stub, tiny_dir, start, end):
    async for _ in stub.Assign(pb.Assignment(start=start, end=end, model_fingerprint=fingerprint(tiny_dir),
                                             options=codec.encode_stage_options({"dtype": "fp32"})), timeout=60):
        pass


def test_malformed_forwards_get_invalid_argument_and_the_worker_keeps_serving(served, tiny_dir):
    start, cfg = served
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
        service, server, port = await start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
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
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stats = codec.decode_stats((await stub.Stats(pb.StatsRequest(), timeout=5)).stats)
            assert stats["state"] == "ready" and stats["layers"] == [3, 6] and stats["sessions"] == 1
            released = await stub.Release(pb.ReleaseRequest(session_ids=["s", "nope"]), timeout=5)
            assert released.released == 1
        await server.stop(0)
        service.close()

    asyncio.run(run())


def test_assignment_is_checked(served, tiny_dir):
    start, _ = served

    async def run():
        service, server, port = await start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.WorkerStub(ch)
            for assignment, code, message in [
                (pb.Assignment(start=0, end=6, model_fingerprint="0" * 16), grpc.StatusCode.FAILED_PRECONDITION,
                 "both must use the same model files"),
                (pb.Assignment(start=0, end=6, model_fingerprint=fingerprint(tiny_dir),
                               options=pb.StageOptions(dtype="fp64")), grpc.StatusCode.INVALID_ARGUMENT,
                 "fp32 or bf16"),
                (pb.Assignment(start=0, end=6, model_fingerprint=fingerprint(tiny_dir),
                               options=pb.StageOptions(none=["warp_drive"])), grpc.StatusCode.INVALID_ARGUMENT,
                 "unknown stage options"),
                (pb.Assignment(start=4, end=9, model_fingerprint=fingerprint(tiny_dir)),
                 grpc.StatusCode.FAILED_PRECONDITION, "not all on this worker's disk"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Assign(assignment, timeout=10):
                        pass
                assert e.value.code() == code and message in e.value.details()
            info = await stub.Info(pb.InfoRequest(), timeout=5)
            assert info.state == "idle"
        await server.stop(0)
        service.close()

    asyncio.run(run())


def test_a_cancelled_assign_closes_what_it_loaded(served, tiny_dir, monkeypatch):
    """The coordinator gives up on an Assign (deadline) while the stage loads: the worker closes that stage
    once its load ends, before the next Assign loads another (never two stages in memory), and serves the
    next assignment."""
    from deltafin.stage import Stage
    from deltafin.worker.service import WorkerService

    start, cfg = served
    events: list[str] = []
    load = WorkerService._load

    def slow_load(self, old, a, b, options, progress):
        events.append(f"load {a}-{b}")
        time.sleep(1.5)
        stage = load(self, old, a, b, options, progress)
        events.append(f"loaded {a}-{b}")
        return stage

    close = Stage.close

    def recorded_close(self):
        events.append(f"close {self.start}-{self.end}")
        close(self)

    monkeypatch.setattr(WorkerService, "_load", slow_load)
    monkeypatch.setattr(Stage, "close", recorded_close)

    async def run():
        service, server, port = await start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.WorkerStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Assign(pb.Assignment(start=0, end=3, model_fingerprint=fingerprint(tiny_dir),
                                                         options=codec.encode_stage_options({})), timeout=0.5):
                    pass
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(0.2)
            assert service.state == "idle" and service.stage is None
            await _assign(stub, tiny_dir, 3, 6)
            info = await stub.Info(pb.InfoRequest(), timeout=5)
        await server.stop(None)
        service.close()
        return info

    info = asyncio.run(run())
    assert events[:4] == ["load 0-3", "loaded 0-3", "close 0-3", "load 3-6"]
    assert (info.assigned.start, info.assigned.end, info.state) == (3, 6, "ready")


def test_stage_options_and_counters_travel_as_typed_messages(tiny_dir: Path) -> None:
    import torch

    from deltafin.pipeline import LocalPipeline
    from deltafin.stage import StageOptions

    defaults = StageOptions(expert_cache_bytes=5_000_000, read_threads=4, max_resident_layers=3)
    sent = {"dtype": "bf16", "memory_bytes": 7 << 30, "expert_cache_bytes": None, "session_bytes": 123,
            "prefetch": False, "max_resident_layers": None}
    got = codec.decode_stage_options(pb.StageOptions.FromString(codec.encode_stage_options(sent)
                                                                .SerializeToString()), defaults)
    assert (got.dtype, got.memory_bytes, got.expert_cache_bytes, got.session_bytes, got.prefetch) == (
        torch.bfloat16, 7 << 30, None, 123, False)
    assert got.max_resident_layers is None and got.read_threads == 4  # unset: the worker's own
    for bad in ({"warp_drive": 1}, {"read_threads": "many"}):
        with pytest.raises(CodecError):
            codec.encode_stage_options(bad)
    pipe = LocalPipeline.load(tiny_dir, 1, "cpu", "fp32", options=StageOptions(expert_cache_bytes=200_000))
    try:
        from deltafin.stage import SeqInput

        pipe.forward([SeqInput("s", 0, ids=torch.tensor([1, 2, 3]))])
        stage = pipe.stages[0]
        stats = {"state": "ready", "name": "w0", **stage.stats(), "sessions": 1, "layers": [0, 6],
                 "plan": stage.sizing.as_dict()}
        back = codec.decode_stats(pb.StageStats.FromString(codec.encode_stats(stats).SerializeToString()))
        assert back["experts"]["lookups"] == stats["experts"]["lookups"] > 0
        assert back["plan"]["total"] == stage.sizing.total and back["layers"] == [0, 6]
        assert back["tokens"] == 3 and back["state"] == "ready"
        with pytest.raises(CodecError, match="no field 'bogus'"):
            codec.encode_stats({**stats, "bogus": 1})
    finally:
        pipe.close()
