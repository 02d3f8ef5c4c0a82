"""Bad input, by property-based tests: the codec, a real worker, the HTTP API.

Every malformed or adversarial payload must get a specific status (never INTERNAL/UNKNOWN, never a crash)
and the worker must keep serving afterwards. Also: unknown and replayed session ids, concurrent calls on
one session, cache budgets, message size limits, idle session expiry, and a checkpoint shard truncated
while the worker runs.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from cluster_util import workers
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltafin.checkpoint import fingerprint
from deltafin.config import load_config
from deltafin.coordinator.backend import LocalBackend
from deltafin.coordinator.engine import Engine
from deltafin.coordinator.server import start
from deltafin.errors import CodecError
from deltafin.pipeline import LocalPipeline
from deltafin.tokenizer import K3Tokenizer
from deltafin.transport import codec
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.transport.generated import deltafin_pb2_grpc as pb_grpc

SPECIFIC = {"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "OUT_OF_RANGE"}
DTYPES = ["float32", "bfloat16", "float16", "int64", "int32", "int8", "", "complex64", "float32\x00"]
SPECIAL_FLOATS = [float("nan"), float("inf"), -float("inf"), 1e38, 0.0]


@st.composite
def tensors(draw, dtype=None, shape=None, vocab: int = 300_000) -> pb.Tensor:
    """Half the time a well-formed tensor (so calls get past the codec), else a broken or hostile one."""
    dtype = dtype or draw(st.sampled_from(DTYPES))
    shape = shape if shape is not None else draw(st.lists(st.integers(-2, 9), max_size=5))
    numel = 1
    for d in shape:
        numel *= max(d, 0)
    size = {"float32": 4, "int32": 4, "int64": 8, "bfloat16": 2, "float16": 2}.get(dtype, 1) * numel
    if not draw(st.booleans()):
        size = max(0, size + draw(st.sampled_from([-1, 1, 7])))
    if dtype == "float32" and size % 4 == 0:
        finite = st.floats(-3, 3, width=32)
        values = draw(st.lists(finite | st.sampled_from(SPECIAL_FLOATS) if draw(st.booleans()) else finite,
                               min_size=size // 4, max_size=size // 4))
        data = struct.pack(f"<{len(values)}f", *values)
    elif dtype in ("int64", "int32") and size % (8 if dtype == "int64" else 4) == 0:
        n = size // (8 if dtype == "int64" else 4)
        high = vocab - 1 if draw(st.booleans()) else vocab + 5
        values = draw(st.lists(st.integers(-1 if high > vocab else 0, high), min_size=n, max_size=n))
        data = struct.pack(f"<{n}{'q' if dtype == 'int64' else 'i'}", *values)
    else:
        data = draw(st.binary(min_size=size, max_size=size))
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


@st.composite
def sequences(draw, hidden: int, blocks: int, vocab: int = 1000) -> pb.SequenceInput:
    msg = pb.SequenceInput(session_id=draw(st.sampled_from(["a", "b", "c", "", "x" * 300, "s\u00e9ssion"])),
                           cache_len=draw(st.sampled_from([0, 0, 0, 1, 2, 3, 5, 2**40])))
    kind = draw(st.sampled_from(["ids", "ids", "state", "state", "both", "none"]))
    if kind in ("ids", "both"):
        t = draw(st.integers(0, 6))
        msg.ids.CopyFrom(draw(tensors(dtype=draw(st.sampled_from(["int64", "int64", "int32", "float32"])),
                                      shape=draw(st.sampled_from([[t], [t], [t, 1], []])), vocab=vocab)))
    if kind in ("state", "both"):
        t = draw(st.integers(0, 4))
        msg.p.CopyFrom(draw(tensors(dtype=draw(st.sampled_from(["float32", "float32", "bfloat16", "int64"])),
                                    shape=draw(st.sampled_from([[t, hidden], [t, hidden], [t, hidden + 1],
                                                                [hidden]])))))
        msg.b.CopyFrom(draw(tensors(dtype="float32", shape=draw(st.sampled_from(
            [[t, blocks, hidden], [t, blocks, hidden], [t, blocks + 1, hidden], [t, hidden]])))))
    return msg


@st.composite
def plausible(draw, first: bool, hidden: int, blocks: int, vocab: int) -> pb.SequenceInput:
    """A well-formed sequence whose session may or may not exist (so the stage, not the codec, judges it)."""
    import torch

    sid = draw(st.sampled_from(["a", "b", "c"]))
    t = draw(st.integers(1, 4))
    msg = pb.SequenceInput(session_id=sid, cache_len=draw(st.sampled_from([0, 0, 1, 2, 4])))
    if first:
        ids = draw(st.lists(st.integers(0, vocab - 1), min_size=t, max_size=t))
        msg.ids.CopyFrom(codec.encode_tensor(torch.tensor(ids, dtype=torch.long)))
    else:
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        msg.p.CopyFrom(codec.encode_tensor(torch.randn(t, hidden, generator=g)))
        msg.b.CopyFrom(codec.encode_tensor(torch.randn(t, blocks, hidden, generator=g)))
    return msg


_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4}  # proto/deltafin.proto, Tensor


def _tensor_ok(t: pb.Tensor) -> bool:
    """The wire format's rules for a tensor, written from the protocol (not from the codec)."""
    numel = 1
    for d in t.shape:
        numel *= d
    return (t.dtype in _SIZES and len(t.shape) <= 4 and all(d >= 0 for d in t.shape) and numel <= 1 << 31
            and len(t.data) == numel * _SIZES[t.dtype])


def _well_formed(msg: pb.SequenceInput) -> bool:
    has_ids, has_p, has_b = msg.HasField("ids"), msg.HasField("p"), msg.HasField("b")
    if not msg.session_id or msg.cache_len < 0 or (msg.resume_from and msg.cache_len == 0):
        return False
    if has_ids:
        return not (has_p or has_b) and _tensor_ok(msg.ids)
    return has_p and has_b and _tensor_ok(msg.p) and _tensor_ok(msg.b)


def _check_decoded(msgs: list[pb.SequenceInput]) -> None:
    """Every message decodes to exactly what it says, unless it breaks the wire format's rules: then the
    whole call is refused (a codec that refused everything would fail here)."""
    try:
        out = codec.decode_inputs(msgs)
    except CodecError:
        assert not all(_well_formed(m) for m in msgs), [str(m)[:200] for m in msgs]
        return
    assert all(_well_formed(m) for m in msgs)
    for item, msg in zip(out, msgs, strict=True):
        assert item.session_id == msg.session_id and item.cache_len == msg.cache_len
        tensor = msg.ids if item.ids is not None else msg.p
        got = item.ids if item.ids is not None else item.state.P
        assert list(got.shape) == list(tensor.shape)
        assert got.reshape(-1).view(torch.uint8).numpy().tobytes() == tensor.data


@settings(max_examples=300, deadline=None)
@given(st.lists(sequences(hidden=16, blocks=2), max_size=3))
def test_codec_rejects_or_decodes_exactly(msgs: list[pb.SequenceInput]) -> None:
    _check_decoded(msgs)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_codec_survives_random_bytes(data: bytes) -> None:
    try:
        request = pb.ForwardRequest.FromString(data)
    except DecodeError:
        return
    _check_decoded(list(request.sequences))


# ---- a real worker -----------------------------------------------------------------------------------------


class Worker:
    def __init__(self, address: str, model: Path):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.WorkerStub(self.channel)
        self.model = model

    def assign(self, start: int, end: int, **options) -> None:
        for _ in self.stub.Assign(pb.Assignment(start=start, end=end, model_fingerprint=fingerprint(self.model),
                                                options=codec.encode_stage_options(options)), timeout=120):
            pass

    def forward(self, *seqs: pb.SequenceInput, timeout: float = 60) -> str:
        try:
            self.stub.Forward(pb.ForwardRequest(request_id="f", sequences=list(seqs)), timeout=timeout)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name

    def forward_detail(self, *seqs: pb.SequenceInput) -> tuple[str, str]:
        try:
            self.stub.Forward(pb.ForwardRequest(sequences=list(seqs)), timeout=60)
            return "OK", ""
        except grpc.RpcError as e:
            return e.code().name, e.details()

    def healthy(self) -> bool:
        h = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        info = self.stub.Info(pb.InfoRequest(), timeout=10)
        return h.status == health_pb2.HealthCheckResponse.SERVING and info.state == "ready"


def ids_seq(sid: str, ids: list[int], cache_len: int = 0) -> pb.SequenceInput:
    import torch

    return pb.SequenceInput(session_id=sid, cache_len=cache_len,
                            ids=codec.encode_tensor(torch.tensor(ids, dtype=torch.long)))


@pytest.fixture(scope="module")
def worker(tiny_dir: Path):
    with workers(tiny_dir, 1, "--max-message-mb", "1", "--session-ttl", "2") as (w,):
        yield Worker(w.address, tiny_dir), w


def test_fuzzed_forwards_get_specific_statuses(worker, tiny_dir: Path) -> None:
    client, proc = worker
    cfg = load_config(tiny_dir)
    seen: dict[str, int] = {}

    for first, last in [(0, cfg.num_layers), (3, cfg.num_layers)]:  # ids in, then residual states in
        client.assign(first, last)
        blocks = cfg.blocks_entering(first)
        good = plausible(first == 0, cfg.hidden_size, blocks, cfg.vocab_size)
        hostile = sequences(hidden=cfg.hidden_size, blocks=blocks, vocab=cfg.vocab_size)

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.lists(good | hostile, min_size=1, max_size=3))
        def fuzz(msgs: list[pb.SequenceInput]) -> None:
            code = client.forward(*msgs)
            seen[code] = seen.get(code, 0) + 1
            assert code == "OK" or code in SPECIFIC, (code, msgs)

        fuzz()
        assert client.healthy() and proc.proc.poll() is None
    print(f"\nfuzzed forwards: {sum(seen.values())}, statuses {seen}")
    client.assign(0, cfg.num_layers)
    assert client.forward(ids_seq("ok", [1, 2, 3])) == "OK"


def test_session_misuse_and_limits(worker, tiny_dir: Path) -> None:
    client, _ = worker
    cfg = load_config(tiny_dir)
    client.assign(0, cfg.num_layers, session_bytes=150_000)
    assert client.forward_detail(ids_seq("ghost", [5], cache_len=4))[0] == "NOT_FOUND"
    assert client.forward(ids_seq("s", [1, 2, 3])) == "OK"
    assert client.forward(ids_seq("s", [4], cache_len=3)) == "OK"
    code, detail = client.forward_detail(ids_seq("s", [4], cache_len=3))  # the same call again
    assert code == "FAILED_PRECONDITION" and "replayed or concurrent" in detail
    assert client.forward(ids_seq("d", [1]), ids_seq("d", [2])) == "INVALID_ARGUMENT"  # one session twice
    # concurrent continuations of one session: exactly one wins
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(client.forward(ids_seq("s", [7], cache_len=4))))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["FAILED_PRECONDITION", "OK"]
    code, detail = client.forward_detail(ids_seq("long", [7] * 3000))  # past the tokens a forward may carry
    assert code == "INVALID_ARGUMENT" and "in chunks" in detail
    code, detail = client.forward_detail(ids_seq("long", [7] * 500))  # past the cache budget
    assert code == "RESOURCE_EXHAUSTED" and "budget" in detail
    big = pb.SequenceInput(session_id="big", cache_len=0, ids=pb.Tensor(dtype="int64", shape=[200_000],
                                                                         data=b"\0" * 1_600_000))
    assert client.forward(big) == "RESOURCE_EXHAUSTED"  # over --max-message-mb 1
    assert client.healthy()


def test_idle_sessions_expire(worker, tiny_dir: Path) -> None:
    client, _ = worker
    client.assign(0, load_config(tiny_dir).num_layers)
    assert client.forward(ids_seq("idle", [1, 2])) == "OK"
    time.sleep(4.5)  # --session-ttl 2, swept every second
    code, detail = client.forward_detail(ids_seq("idle", [3], cache_len=2))
    assert code == "NOT_FOUND" and "expired" in detail
    stats = codec.decode_stats(client.stub.Stats(pb.StatsRequest(), timeout=10).stats)
    assert stats["sessions"] == 0


def test_truncated_shard_fails_the_request_clearly(tiny_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_dir, model)
    cfg = load_config(model)
    with workers(model, 1, "--expert-cache-gb", "0.0001", "--no-prefetch") as (w,):
        client = Worker(w.address, model)
        client.assign(0, cfg.num_layers, expert_cache_bytes=1, prefetch=False)
        assert client.forward(ids_seq("a", [1, 2, 3])) == "OK"
        index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
        shard = next(f for name, f in index.items() if ".experts." in name)
        size = os.path.getsize(model / shard)
        os.truncate(model / shard, size // 2)
        codes = [client.forward_detail(ids_seq(f"t{i}", [i + 1, 40, 90, 7])) for i in range(4)]
        failed = [(c, d) for c, d in codes if c != "OK"]
        assert failed and all(c == "DATA_LOSS" and shard in d and "truncated" in d for c, d in failed)
        h = health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert h.status == health_pb2.HealthCheckResponse.SERVING and w.proc.poll() is None


# ---- the HTTP API -------------------------------------------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
                    | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
MUTATIONS = {
    "model": st.sampled_from(["other", 3, None, ""]), "max_tokens": st.sampled_from([0, -1, "2", 10**12, 3]),
    "temperature": st.sampled_from([0.5, -1, 3e9, "hot", None]), "top_p": st.sampled_from([0.5, 0, 2, True]),
    "top_k": st.sampled_from([-1, 0, 5, 1.5]), "n": st.sampled_from([1, 2, "1"]),
    "stop": st.sampled_from(["x", ["a", "b"], [""], ["x"] * 20, 5]) | JSON,
    "logprobs": JSON, "top_logprobs": st.sampled_from([0, 5, 50, -1]) | JSON, "seed": JSON,
    "stream": st.sampled_from([True, "yes", None]), "logit_bias": st.sampled_from([{"1": 5}, {"x": 1}, {"1": 500}])
    | JSON, "tools": JSON, "tool_choice": st.sampled_from(["auto", "required", "none", {"function": {}}]) | JSON,
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "x"}]) | JSON,
    "reasoning_effort": st.sampled_from(["low", "none", "medium", 1]), "stream_options": JSON,
    "messages": st.sampled_from([[], "hi", [{"role": 1}], [{"role": "user", "content": ["x", {"type": "video"}]}],
                                 [{"role": "tool", "content": "orphan"}], [{"role": "user", "content": "x" * 400}],
                                 [{"role": "user", "content": None}]]) | JSON,
    "prompt": st.sampled_from(["", [], [1, 2], [[1], [2]], [10**9], "ok", ["a", "b"]]) | JSON,
}


@st.composite
def api_requests(draw) -> tuple[str, dict]:
    """A valid request with a few fields replaced by odd or hostile values."""
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    for name in draw(st.lists(st.sampled_from(sorted(MUTATIONS)), max_size=3, unique=True)):
        body[name] = draw(MUTATIONS[name])
    return path, body


@pytest.fixture(scope="module")
def api_url(tiny_dir: Path):
    """An API server on its own event loop thread (hypothesis drives it synchronously)."""
    import asyncio

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    pipe = LocalPipeline.load(tiny_dir, 1, "cpu", "fp32")

    async def up():
        engine = Engine(LocalBackend(pipe), K3Tokenizer.load(tiny_dir), load_config(tiny_dir), "tiny",
                        max_context=256)
        runner, port = await start(engine, "127.0.0.1", 0)
        return engine, runner, port

    engine, runner, port = asyncio.run_coroutine_threadsafe(up(), loop).result(60)
    yield f"http://127.0.0.1:{port}"

    async def down():
        await runner.cleanup()
        await engine.close()

    asyncio.run_coroutine_threadsafe(down(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)


def _post(url: str, body: object) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_api_fuzz_never_500(api_url: str) -> None:
    statuses: dict[int, int] = {}

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
    @given(api_requests())
    def fuzz(request: tuple[str, dict]) -> None:
        path, body = request
        code, text = _post(api_url + path, body)
        statuses[code] = statuses.get(code, 0) + 1
        assert code in (200, 400, 404), (code, body, text)
        if code != 200:
            error = json.loads(text)["error"]
            assert error["message"] and error["type"]

    fuzz()
    code, text = _post(api_url + "/v1/completions", {"model": "tiny", "prompt": "ok", "max_tokens": 1})
    assert code == 200
    health = json.loads(urllib_get(api_url + "/health"))
    assert health["workers"][0]["sessions"] == 0
    print(f"\nfuzzed API requests: {sum(statuses.values())}, statuses {statuses}")


def urllib_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()
