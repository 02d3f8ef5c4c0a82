"""Bad input to the codec, by property-based tests: every message either decodes to exactly what it carries or
is refused with CodecError, checked against the wire rules written from the protocol."""

from __future__ import annotations

import torch
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from deltafin.errors import CodecError
from deltafin.transport import codec
from deltafin.transport.generated import deltafin_pb2 as pb
from tests.support.strategies import sequences

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
    if has_ids:  # ids [T]
        return not (has_p or has_b) and _tensor_ok(msg.ids) and len(msg.ids.shape) == 1
    return (has_p and has_b and _tensor_ok(msg.p) and _tensor_ok(msg.b)  # P [T, D], B [T, n, D]
            and len(msg.p.shape) == 2 and len(msg.b.shape) == 3 and msg.p.shape[0] == msg.b.shape[0])


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
