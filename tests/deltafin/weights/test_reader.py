"""The reader's slot pool: resized only while every slot is free, the pages of the slots it drops given back."""

from __future__ import annotations

import sys

import pytest

from deltafin.weights.reader import SlotPool


def test_a_pool_gives_back_the_pages_of_the_slots_it_drops() -> None:
    pool = SlotPool(4, 8192)
    for slot in range(4):
        pool.memory(slot)[:] = bytes([slot + 1]) * pool.size
    held = pool.acquire()
    with pytest.raises(RuntimeError, match="resized while 1 are in use"):
        pool.resize(2)
    pool.release(held)
    pool.resize(2)
    assert pool.count == 2 and pool.nbytes == 2 * pool.size
    assert sorted(pool.acquire() for _ in range(2)) == [0, 1]
    with pytest.raises(RuntimeError, match="no free expert buffer"):
        pool.acquire(timeout=0.01)
    assert bytes(pool.memory(1)) == bytes([2]) * pool.size  # the slots kept keep their bytes
    if sys.platform.startswith("linux"):  # MADV_DONTNEED on private memory: freed, zero when touched again
        assert bytes(pool.memory(3)) == bytes(pool.size)
    for slot in (0, 1):
        pool.release(slot)
    pool.resize(4)
    assert sorted(pool.acquire() for _ in range(4)) == [0, 1, 2, 3]
    for slot in range(4):
        pool.release(slot)
    with pytest.raises(ValueError, match="cannot grow to 5"):
        pool.resize(5)
