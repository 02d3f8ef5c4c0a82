"""A GPU's expert slots (weights/expert_slots.py DeviceSlots), on the CPU: made again for a lent cache, their old
memory goes at once even while a stale view of it is still referenced (on an H100 a landed read's future kept a K3
cache of 36 GB alive while the prompt's forward asked for 34 GB more)."""

from __future__ import annotations

import pytest
import torch

from deltafin.weights.expert_slots import DeviceSlots


def test_slots_made_again_free_the_old_memory_whatever_views_remain() -> None:
    slots = DeviceSlots(8, 4096, torch.device("cpu"))
    stale = slots.tensor[5]  # as a finished read's weights would hold it
    slots.tensor.fill_(7)
    slots.resize(3)
    assert stale.untyped_storage().nbytes() == 0  # the 32 KB went with the resize, not with the last view
    assert slots.tensor.shape == (3, 4096) and slots.count == 3 and slots.nbytes == 3 * 4096
    slots.resize(8)
    assert slots.tensor.shape == (8, 4096) and slots.tensor.untyped_storage().nbytes() == 8 * 4096


def test_slots_are_made_again_only_while_every_one_is_free() -> None:
    slots = DeviceSlots(4, 64, torch.device("cpu"))
    taken = slots.acquire()
    with pytest.raises(RuntimeError, match="resized while 1 are in use"):
        slots.resize(2)
    slots.release(taken)
    slots.resize(2)
    assert slots.count == 2
