"""The replay journal on its own: its size accounting and its budget."""

from __future__ import annotations

import torch

from deltafin.coordinator.cluster.journal import ReplayJournal
from deltafin.runtime.stage import SeqInput


def test_the_journal_is_bounded() -> None:
    journal = ReplayJournal(budget=10)
    for sid in "abc":
        journal.record([SeqInput(sid, 0, ids=torch.tensor([1, 2, 3, 4]))])
    assert list(journal.sessions) == ["b", "c"] and journal.size == 8  # "a", the least recent, lost its record
