"""Fuzzing the running servers, shared by the tests (a bounded number of examples) and the soak command
(`python -m tests.system.fuzz --minutes N`): hypothesis strategies for the HTTP bodies of every route and for
every RPC's message, and runners that send them to a real `serve` or `deltafin-worker` process and count the
answers by route (or RPC) and status. What must never happen: a 5xx (HTTP), INTERNAL or UNKNOWN (gRPC), an
answer slower than STALL_S, a server or worker that stops answering valid requests."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltafin.transport import codec
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.transport.generated import deltafin_pb2_grpc as pb_grpc
from tests.support.strategies import sequences, tensors

STALL_S = 30.0  # an answer slower than this is a stall (the report's: 22.9-59 s for one request)
HTTP_OK = {200, 400, 401, 404, 413, 415, 429}
GRPC_BAD = {"INTERNAL", "UNKNOWN"}

# ---- HTTP ----------------------------------------------------------------------------------------------------

SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
           | st.sampled_from(["", "x", "a\ud800b", "\u0000", "🙂" * 3, "x" * 600]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=16)
HOSTILE_RAW = st.sampled_from([
    "[" * 5000 + "]" * 5000, '{"a": ' + "9" * 5000 + "}", "{nope", "", "null", '"x"',
    '{"stop": ["' + "z" * 2000 + '"]}',
    '{"prompt": "a\\ud800b", "echo": true}', '{"messages": [{"role": "assistant", "tool_calls": 5}]}',
])
HEADERS = st.sampled_from([{}, {}, {}, {"Content-Type": "application/json; charset=bogus"},
                           {"Content-Encoding": "deflate"}, {"Content-Type": "text/plain"}])
CHAT = [{"role": "user", "content": "hi"}]
ROUTES: dict[str, dict[str, Any]] = {  # a valid body each: mutated field by field
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 2, "temperature": 0},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2, "temperature": 0},
    "/v1/messages": {"messages": CHAT, "max_tokens": 2, "temperature": 0},
    "/v1/messages/count_tokens": {"messages": CHAT},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2, "temperature": 0},
    "/api/chat": {"messages": CHAT, "stream": False, "options": {"temperature": 0, "num_predict": 2}},
    "/api/generate": {"prompt": "hi", "stream": False, "options": {"temperature": 0, "num_predict": 2}},
    "/api/show": {"model": "tiny"},
}
GETS = ["/v1/models", "/v1/models/x", "/health", "/v1/status", "/metrics", "/api/tags", "/api/ps", "/api/version",
        "/nope"]
FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream", "n",
          "logit_bias", "logprobs", "tools", "tool_choice", "messages", "prompt", "input", "system", "thinking",
          "options", "think", "format", "reasoning", "instructions", "echo", "stop_sequences", "frequency_penalty",
          "presence_penalty", "max_output_tokens", "response_format", "stream_options", "text"]


@st.composite
def http_requests(draw: Any) -> tuple[str, str, bytes, dict[str, str]]:
    """(method, path, body, headers): a route's valid body with a few fields replaced by odd or hostile JSON, or
    a hostile raw body, or a GET."""
    kind = draw(st.sampled_from(["mutated"] * 6 + ["raw", "get"]))
    if kind == "get":
        return "GET", draw(st.sampled_from(GETS)), b"", {}
    path = draw(st.sampled_from(sorted(ROUTES)))
    if kind == "raw":
        return "POST", path, draw(HOSTILE_RAW).encode(), draw(HEADERS)
    body = dict(ROUTES[path])
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        body[name] = draw(JSON)
    return "POST", path, json.dumps(body).encode(), draw(HEADERS)


def send_http(url: str, method: str, path: str, data: bytes, headers: dict[str, str]) -> tuple[int, float]:
    """The status and the seconds it took (a streamed 200 is read to its end)."""
    request = urllib.request.Request(url + path, data=data if method == "POST" else None, method=method,
                                     headers={"Content-Type": "application/json", **headers})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=STALL_S * 2) as r:
            r.read()
            return r.status, time.monotonic() - t0
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, time.monotonic() - t0


def fuzz_http(url: str, examples: int, counts: Counter | None = None, seed: int | None = None) -> Counter:
    """`examples` requests; every one answered below 500 within STALL_S (AssertionError naming it otherwise).
    Counts (route, status)."""
    counts = Counter() if counts is None else counts

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=seed is not None)
    @given(http_requests())
    def one(request: tuple[str, str, bytes, dict[str, str]]) -> None:
        method, path, data, headers = request
        status, seconds = send_http(url, method, path, data, headers)
        counts[(path, status)] += 1
        assert status in HTTP_OK, (status, method, path, data[:300], headers)
        assert seconds < STALL_S, ("stall", seconds, path, data[:300])

    one()
    return counts


# ---- gRPC ----------------------------------------------------------------------------------------------------


def _fields(message: type, values: st.SearchStrategy) -> st.SearchStrategy:
    """A `message` with up to four of its fields set to odd values (ints, format and device names, flags)."""
    names = [f.name for f in message.DESCRIPTOR.fields if f.message_type is None]

    @st.composite
    def build(draw: Any) -> Any:
        msg = message()
        for name in draw(st.lists(st.sampled_from(names), max_size=4, unique=True)):
            field = message.DESCRIPTOR.fields_by_name[name]
            value = draw(values)
            try:
                if field.is_repeated:
                    getattr(msg, name).append(value)
                else:
                    setattr(msg, name, value)
            except (TypeError, ValueError):
                pass  # a value this field's type cannot carry: leave it out
        return msg

    return build()


ODD_VALUES = (st.integers(-2**40, 2**40) | st.sampled_from(["fp4", "mmap", "q4", "", "auto", "lru", "cpu", "none"])
              | st.booleans() | st.floats(-2, 3))


@st.composite
def grpc_calls(draw: Any, fingerprint: str, layers: int, hidden: int, blocks: int, vocab: int
               ) -> tuple[str, Any]:
    """(RPC, request message or raw bytes) over every RPC of the Worker service."""
    rpc = draw(st.sampled_from(["Assign", "Forward", "Release", "Cancel", "Stats", "Info", "RunExperts",
                                "FindPrefix", "HeldPrefixes", "raw"]))
    ids = st.lists(st.sampled_from(["a", "b", "", "x" * 300, "p" * 32]), max_size=3)
    if rpc == "Assign":
        start = draw(st.integers(-1, layers + 1))
        request = pb.Assignment(start=start, end=draw(st.integers(-1, layers + 1)),
                                options=draw(_fields(pb.StageOptions, ODD_VALUES)),
                                model_fingerprint=draw(st.sampled_from([fingerprint, fingerprint, "other", ""])))
        if draw(st.booleans()):  # a plan, most often malformed
            request.plan.CopyFrom(draw(_fields(pb.StagePlan, ODD_VALUES)))
        return rpc, request
    if rpc == "Forward":
        seqs = draw(st.lists(sequences(hidden=hidden, blocks=blocks, vocab=vocab), min_size=0, max_size=3))
        for s in seqs:
            if draw(st.booleans()):
                s.save_at.add(tokens=draw(st.integers(-2, 9)), prefix_id=draw(st.sampled_from(["k", "", "k"])))
        return rpc, pb.ForwardRequest(request_id="fuzz", sequences=seqs, all_logits=draw(st.booleans()))
    if rpc == "Release":
        sids = draw(ids)
        return rpc, pb.ReleaseRequest(session_ids=sids, keep_as=draw(st.lists(st.sampled_from(["", "k"]),
                                                                               max_size=3)),
                                      keep_lengths=draw(st.lists(st.integers(-3, 9), max_size=3)))
    if rpc == "Cancel":
        return rpc, pb.CancelRequest(request_id=draw(st.sampled_from(["", "fuzz", "x" * 500])))
    if rpc in ("Stats", "Info"):
        return rpc, pb.StatsRequest() if rpc == "Stats" else pb.InfoRequest()
    if rpc == "RunExperts":
        return rpc, pb.ExpertRequest(layer=draw(st.integers(-2, layers + 2)), z=draw(tensors(dtype="float32")),
                                     rows=draw(tensors(dtype="int64")), experts=draw(tensors(dtype="int64")),
                                     hints=[pb.ExpertHint(layer=draw(st.integers(-2, layers + 2)),
                                                          experts=draw(st.lists(st.integers(-5, 2**31 - 1),
                                                                                max_size=4)))])
    if rpc == "FindPrefix":
        return rpc, pb.FindPrefixRequest(tokens=draw(tensors(dtype=draw(st.sampled_from(["int64", "int32",
                                                                                           "float32"])),
                                                             vocab=vocab)))
    if rpc == "HeldPrefixes":
        return rpc, pb.HeldPrefixesRequest(prefix_ids=draw(ids), logits_for=draw(st.sampled_from(["", "k", "a"])))
    return draw(st.sampled_from(["Forward", "Assign", "FindPrefix", "Release"])), draw(st.binary(max_size=64))


def send_grpc(channel: grpc.Channel, rpc: str, request: Any) -> str:
    """The status name of one call (a streamed answer read to its end)."""
    raw = isinstance(request, bytes)
    streamed = rpc in ("Assign", "RunExperts")
    stub = channel.unary_stream if streamed else channel.unary_unary
    call = stub(f"/deltafin.v1.Worker/{rpc}", request_serializer=(lambda b: b) if raw else
                (lambda m: m.SerializeToString()), response_deserializer=lambda b: b)
    try:
        result = call(request, timeout=STALL_S)
        if streamed:
            list(result)
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def fuzz_grpc(address: str, examples: int, model: dict[str, Any], valid: Callable[[], str],
              counts: Counter | None = None) -> Counter:
    """`examples` calls; none answered INTERNAL/UNKNOWN or slower than STALL_S; after every Assign the worker
    still answers `valid()` (a valid plan's forward, re-assigning it if a fuzzed Assign replaced it) with OK."""
    counts = Counter() if counts is None else counts
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 1 << 30)])

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(grpc_calls(**model))
    def one(call: tuple[str, Any]) -> None:
        rpc, request = call
        t0 = time.monotonic()
        status = send_grpc(channel, rpc, request)
        counts[(rpc, status)] += 1
        assert status not in GRPC_BAD, (rpc, status, request)
        assert time.monotonic() - t0 < STALL_S, ("stall", rpc, request)
        if rpc == "Assign":
            answer = valid()
            assert answer == "OK", ("the worker serves no valid plan after", request, answer)

    one()
    channel.close()
    return counts


def valid_forward(address: str, fingerprint: str, layers: int) -> Callable[[], str]:
    """A forward of the whole model's layers from token ids, the valid plan (default options) assigned first where
    the worker holds another, or where the plan it holds refuses the forward (a fuzzed plan it took may have
    options no 3-token forward fits, such as forwards of one token): what a coordinator does after a refused or
    replaced plan. "OK", or the status that the valid plan itself got."""
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.WorkerStub(channel)
    n = [0]

    def assign() -> None:
        list(stub.Assign(pb.Assignment(start=0, end=layers, model_fingerprint=fingerprint), timeout=STALL_S))

    def forward() -> str:
        n[0] += 1
        seq = pb.SequenceInput(session_id=f"valid{n[0]}", ids=codec.encode_tensor(torch.tensor([1, 2, 3])))
        try:
            stub.Forward(pb.ForwardRequest(request_id="valid", sequences=[seq]), timeout=STALL_S)
            stub.Release(pb.ReleaseRequest(session_ids=[f"valid{n[0]}"]), timeout=STALL_S)
            return "OK"
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"

    def run() -> str:
        info = stub.Info(pb.InfoRequest(), timeout=STALL_S)
        if (info.assigned.start, info.assigned.end) != (0, layers) or info.state != "ready":
            assign()
            return forward()
        if forward() == "OK":
            return "OK"
        assign()  # the fuzzed plan it holds refused the forward: the valid plan must serve it
        return forward()

    return run
