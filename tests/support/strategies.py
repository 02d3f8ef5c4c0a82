"""Hypothesis strategies for wire messages: tensors and sequence inputs, half well-formed and half broken or
hostile (shared by the codec's and the worker's fuzz tests)."""

from __future__ import annotations

import random
import struct

from hypothesis import strategies as st

from deltafin.transport.generated import deltafin_pb2 as pb

DTYPES = ["float32", "bfloat16", "float16", "int64", "int32", "int8", "", "complex64", "float32\x00"]


SPECIAL_FLOATS = [float("nan"), float("inf"), -float("inf"), 1e38, 0.0]
DRAWN_VALUES = 1024  # a tensor's values drawn one by one up to this many (hypothesis refuses lists near 8,192)


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
        n = size // 4
        special = draw(st.booleans())
        if n <= DRAWN_VALUES:
            finite = st.floats(-3, 3, width=32)
            values = draw(st.lists(finite | st.sampled_from(SPECIAL_FLOATS) if special else finite,
                                   min_size=n, max_size=n))
        else:  # past what hypothesis draws one by one: seeded values, a special one in place if asked
            rng = random.Random(draw(st.integers(0, 2**32 - 1)))
            values = [rng.uniform(-3, 3) for _ in range(n)]
            if special:
                values[rng.randrange(n)] = rng.choice(SPECIAL_FLOATS)
        data = struct.pack(f"<{n}f", *values)
    elif dtype in ("int64", "int32") and size % (8 if dtype == "int64" else 4) == 0:
        n = size // (8 if dtype == "int64" else 4)
        high = vocab - 1 if draw(st.booleans()) else vocab + 5
        low = -1 if high > vocab else 0
        if n <= DRAWN_VALUES:
            values = draw(st.lists(st.integers(low, high), min_size=n, max_size=n))
        else:
            rng = random.Random(draw(st.integers(0, 2**32 - 1)))
            values = [rng.randint(low, high) for _ in range(n)]
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
