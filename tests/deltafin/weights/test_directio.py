"""The direct-I/O writer writes exactly the bytes it is given, holes included."""

from __future__ import annotations

import os

import numpy as np

from deltafin.weights.directio import DirectWriter


def test_direct_writer_writes_exact_bytes(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=3 * (1 << 20) + 12345, dtype=np.uint8).tobytes()
    with DirectWriter(tmp_path / "f", staging=1 << 20) as w:
        w.write(data[:100])
        w.write(data[100:])
    assert (tmp_path / "f").read_bytes() == data


def test_direct_writer_leaves_holes(tmp_path):
    head, tail = b"h" * 5000, b"t" * 3000
    with DirectWriter(tmp_path / "f") as w:
        w.write(head)
        w.skip(64 << 20)
        w.write(tail)
    raw = (tmp_path / "f").read_bytes()
    assert raw == head + bytes(64 << 20) + tail
    assert os.stat(tmp_path / "f").st_blocks * 512 < 1 << 20  # 64 MB apparent, a few blocks on disk
