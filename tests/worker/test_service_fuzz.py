"""Bad input to a real worker, by property-based tests: every malformed or adversarial payload gets a
specific status (never INTERNAL/UNKNOWN, never a crash) and the worker keeps serving. Also: unknown and
replayed session ids, concurrent calls on one session, cache budgets, message size limits, idle session
expiry, and a checkpoint shard truncated while the worker runs."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import fingerprint
from deltafin.transport import codec
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.transport.generated import deltafin_pb2_grpc as pb_grpc
from tests.support.cluster import workers
from tests.support.plans import assignment, stage_plan
from tests.support.strategies import sequences

SPECIFIC = {"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "OUT_OF_RANGE"}


@st.composite
def plausible(draw, first: bool, hidden: int, blocks: int, vocab: int) -> pb.SequenceInput:
    """A well-formed sequence whose session may or may not exist (so the stage, not the codec, judges it)."""

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


# ---- a real worker -----------------------------------------------------------------------------------------


class Worker:
    def __init__(self, address: str, model: Path):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.WorkerStub(self.channel)
        self.model = model

    def assign(self, start: int, end: int, **values) -> None:
        """Layers [start, end), as `values` say: its options, and the sizing knobs a coordinator's plan fixes."""
        for _ in self.stub.Assign(assignment(self.model, fingerprint(self.model), start, end, **values),
                                  timeout=120):
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
    client.assign(0, cfg.num_layers, session_bytes=150_000, prefill_chunk=2048)
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
    assert stats.sessions == 0


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


# ---- the fuzz report's cases, one call each --------------------------------------------------------------------


def _status(call) -> tuple[str, str]:
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
        return "OK", ""
    except grpc.RpcError as e:
        return e.code().name, e.details()


BAD_OPTIONS = [pb.StageOptions(io="mmap"), pb.StageOptions(read_threads=0), pb.StageOptions(read_threads=-1),
               pb.StageOptions(dtype="fp16"), pb.StageOptions(cache_policy="fifo"), pb.StageOptions(prefetch_layers=0),
               pb.StageOptions(wire="fp8")]
# a plan's fields changed: (field, value, status, words the refusal says)
BAD_PLANS = [("spine", "fp4", "INVALID_ARGUMENT", "unknown spine"), ("device", "tpu", "INVALID_ARGUMENT", "device"),
             ("start", 2, "INVALID_ARGUMENT", "must be layers 2-5"),
             ("expert_share", 2.0, "INVALID_ARGUMENT", "expert_share"),
             ("workspace", -1, "INVALID_ARGUMENT", "workspace out of range"),
             ("sessions", 0, "RESOURCE_EXHAUSTED", "no room for any sequence"),
             ("sessions", 10**13, "RESOURCE_EXHAUSTED", "budget"),
             ("device", "cuda", "RESOURCE_EXHAUSTED", "this worker computes on cpu")]


def test_a_refused_assignment_leaves_the_old_one_serving(worker, tiny_dir: Path) -> None:
    """Each option the command line refuses is refused off the wire too, and so is a plan that is malformed, is for
    other layers or another device, leaves no sequence or does not fit the worker's budget (INVALID_ARGUMENT, or
    RESOURCE_EXHAUSTED for what its memory cannot hold), before the assigned stage goes: a forward still works
    after each, and a valid assignment is taken at once (the report's wedged worker took none after a bad one)."""
    client, proc = worker
    cfg = load_config(tiny_dir)
    client.assign(0, cfg.num_layers)
    good = stage_plan(tiny_dir, 0, cfg.num_layers)
    bad_plans = []
    for name, value, code, words in BAD_PLANS:
        plan = pb.StagePlan()
        plan.CopyFrom(good)
        setattr(plan, name, value)
        bad_plans.append((pb.Assignment(plan=plan), code, words))
    bad_options = [(pb.Assignment(options=o), "INVALID_ARGUMENT", "") for o in BAD_OPTIONS]
    for i, (bad, want, words) in enumerate(bad_options + bad_plans):
        request = pb.Assignment(start=0, end=cfg.num_layers, model_fingerprint=fingerprint(client.model))
        request.MergeFrom(bad)
        code, detail = _status(lambda request=request: client.stub.Assign(request, timeout=60))
        assert code == want and detail and words in detail, (bad, code, detail)
        assert client.forward(ids_seq(f"still{i}", [1, 2, 3])) == "OK", bad
    holder = pb.Holder(worker_id=client.stub.Info(pb.InfoRequest(), timeout=10).worker_id, address="x", name="me")
    alone = pb.ExpertPlacement(holders=[holder], layers=[pb.LayerExperts(layer=i, bounds=[0, cfg.num_experts])
                                                    for i in cfg.moe_layers])
    request = pb.Assignment(start=0, end=cfg.num_layers, model_fingerprint=fingerprint(client.model), experts=alone)
    assert _status(lambda: client.stub.Assign(request, timeout=60))[0] == "INVALID_ARGUMENT"
    client.assign(0, cfg.num_layers, max_resident_layers=0)
    assert client.forward(ids_seq("streamed", [1, 2, 3])) == "OK"
    assert client.healthy() and proc.proc.poll() is None


def test_streaming_every_layer_needs_buffers_of_the_models_size(tiny_dir: Path) -> None:
    """`max_resident_layers=0` once mapped and prefaulted 21.2 GB for a 26.8 MB model. The peak RSS a worker
    reports is its process's since it started, so this takes a worker of its own: its peak is then its start,
    this assignment and one forward, not whatever the module's shared worker served before."""
    cfg = load_config(tiny_dir)
    with workers(tiny_dir, 1) as (w,):
        client = Worker(w.address, tiny_dir)
        # the spine as stored: a converted one's copy is written first, and where the disk lacks the room the
        # worker plans without it (and then holds layers): this test's subject is the streaming buffers alone
        client.assign(0, cfg.num_layers, max_resident_layers=0, spine="bf16")
        assert client.forward(ids_seq("streamed", [1, 2, 3])) == "OK"
        stats = codec.decode_stats(client.stub.Stats(pb.StatsRequest(), timeout=10).stats)
        assert stats.plan is not None and stats.plan.resident_layers == () and stats.rss_peak_bytes < 2e9, stats


def test_malformed_requests_and_out_of_range_ids_are_invalid_argument(worker, tiny_dir: Path) -> None:
    client, _ = worker
    client.assign(0, load_config(tiny_dir).num_layers)
    for method in ("Info", "Forward", "Release", "Cancel", "Stats", "RunExperts", "FindPrefix", "HeldPrefixes"):
        raw = client.channel.unary_unary(f"/deltafin.v1.Worker/{method}", request_serializer=lambda b: b,
                                         response_deserializer=lambda b: b)
        code, detail = _status(lambda raw=raw: raw(b"\xff\xff\xff\xff\x0f", timeout=10))
        assert code == "INVALID_ARGUMENT" and method in detail, (method, code, detail)
    ids = codec.encode_tensor(torch.tensor([2**40]))
    code, detail = _status(lambda: client.stub.FindPrefix(pb.FindPrefixRequest(tokens=ids), timeout=10))
    assert code == "INVALID_ARGUMENT" and "token ids" in detail
    assert client.healthy()


def test_inputs_of_the_wrong_rank_are_invalid_argument(worker, tiny_dir: Path) -> None:
    """The soak's case: a 0-D tensor of ids (8 bytes, no shape) with every position's logits asked for was INTERNAL
    (its token count was taken before its shape was checked); ids and residual states of the wrong rank are refused
    by name, whatever else the forward asks for."""
    client, _ = worker
    cfg = load_config(tiny_dir)
    d, n = cfg.hidden_size, cfg.blocks_entering(3)

    def refused(request: pb.ForwardRequest) -> str:
        code, detail = _status(lambda: client.stub.Forward(request, timeout=30))
        assert code == "INVALID_ARGUMENT", (code, detail)
        return detail

    scalar = pb.Tensor(dtype="int64", data=b"\0" * 8)
    client.assign(0, cfg.num_layers)
    for extra in ({"all_logits": True}, {}):
        assert "1-D tensor of token ids" in refused(pb.ForwardRequest(
            request_id="fuzz", sequences=[pb.SequenceInput(session_id="a", ids=scalar)], **extra))
    detail = refused(pb.ForwardRequest(sequences=[pb.SequenceInput(session_id="a", ids=scalar, speculative=True)]))
    assert "1-D" in detail
    two_d = codec.encode_tensor(torch.zeros(2, 2, dtype=torch.long))
    assert "got shape [2, 2]" in refused(pb.ForwardRequest(sequences=[pb.SequenceInput(session_id="a", ids=two_d)]))
    client.assign(3, cfg.num_layers)
    for p, b in [(torch.zeros(d), torch.zeros(1, n, d)), (torch.zeros(2, d), torch.zeros(1, n, d)),
                 (torch.zeros(1, d), torch.zeros(n, d))]:
        seq = pb.SequenceInput(session_id="a", p=codec.encode_tensor(p), b=codec.encode_tensor(b))
        assert "P [T, D] and B [T, N, D]" in refused(pb.ForwardRequest(sequences=[seq], all_logits=True))
    assert client.forward(pb.SequenceInput(session_id="a", p=codec.encode_tensor(torch.zeros(1, d)),
                                           b=codec.encode_tensor(torch.zeros(1, n, d)))) == "OK"
    client.assign(0, cfg.num_layers)
    assert client.forward(ids_seq("ok", [1, 2])) == "OK" and client.healthy()


def test_with_a_key_nothing_is_parsed_before_the_signature(tiny_dir: Path, tmp_path: Path) -> None:
    """Unsigned garbage is UNAUTHENTICATED (not a decode error: nothing is parsed for an unknown caller), and so is
    a header whose time has 5,000 digits (the report: UNKNOWN)."""
    from deltafin.transport.auth import HEADER

    key = tmp_path / "key"
    key.write_text("k" * 32)
    with workers(tiny_dir, 1, "--cluster-key-file", str(key)) as (w,):
        channel = grpc.insecure_channel(w.address)
        raw = channel.unary_unary("/deltafin.v1.Worker/Forward", request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
        assert _status(lambda: raw(b"\xff\xff\xff\xff\x0f", timeout=10))[0] == "UNAUTHENTICATED"
        stamp = "9" * 5000
        header = ((HEADER, f"v1.{stamp}.00.{'0' * 64}"),)
        code, detail = _status(lambda: raw(b"", timeout=10, metadata=header))
        assert code == "UNAUTHENTICATED" and "malformed" in detail


def test_every_rpc_fuzzed_answers_specifically_and_the_worker_keeps_a_valid_plan(worker, tiny_dir: Path) -> None:
    """Every RPC of the Worker service with fuzzed messages (options the command line refuses, ranges past the
    model, tensors of any shape, garbage bytes): never INTERNAL or UNKNOWN, never a stall, and after every Assign
    the worker still takes and serves a valid plan. (`python -m tests.system.fuzz --surface grpc --minutes N` is
    the long run.)"""
    from tests.support.fuzz import fuzz_grpc, valid_forward

    client, proc = worker
    cfg = load_config(tiny_dir)
    model = {"fingerprint": fingerprint(tiny_dir), "layers": cfg.num_layers, "hidden": cfg.hidden_size,
             "blocks": cfg.blocks_entering(0), "vocab": cfg.vocab_size}
    counts = fuzz_grpc(proc.address, 300, model, valid_forward(proc.address, model["fingerprint"], cfg.num_layers))
    assert client.healthy() and proc.proc.poll() is None
    print(f"\nfuzzed RPCs: {sum(counts.values())}, by RPC and status {dict(sorted(counts.items()))}")
