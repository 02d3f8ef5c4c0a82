"""The replay journal on its own: its size accounting and its budget."""

from __future__ import annotations

import torch

from deltafin.coordinator.cluster.journal import ReplayJournal
from deltafin.runtime.stage_io import SeqInput


def test_the_journal_is_bounded() -> None:
    journal = ReplayJournal(budget=10)
    for sid in "abc":
        journal.record([SeqInput(sid, 0, ids=torch.tensor([1, 2, 3, 4]))])
    assert list(journal.sessions) == ["b", "c"] and journal.size == 8  # "a", the least recent, lost its record


def test_states_kept_inside_a_forward_and_prefixes_kept_before_are_replayable() -> None:
    """A forward that keeps states inside it records each as the forwards up to that point, the last cut there;
    a prefix the stages kept before this journal existed is recorded from its tokens in forwards of the stage's
    size when a request resumes from it, and a session resumed from it replays from token 0."""
    journal = ReplayJournal(budget=1000)
    journal.record([SeqInput("a", 0, ids=torch.arange(10), save_at=((4, "p4"), (10, "p10")))])
    journal.record([SeqInput("a", 10, ids=torch.arange(10, 16), save_at=((13, "p13"),))])
    p13 = journal.prefixes["p13"]
    assert list(p13.ids) == list(range(13)) and (list(p13.chunks), list(p13.starts)) == ([10, 3], [0, 10])
    assert list(journal.prefixes["p4"].chunks) == [4] and list(journal.prefixes["p10"].ids) == list(range(10))
    journal.know_prefix("old", list(range(100, 125)), chunk=10)
    old = journal.prefixes["old"]
    assert (list(old.chunks), list(old.starts)) == ([10, 10, 5], [0, 10, 20])
    journal.record([SeqInput("b", 25, ids=torch.tensor([7]), resume_from="old")])
    forwards = journal.sessions["b"].forwards()
    assert [f.cache_len for f in forwards] == [0, 10, 20, 25]
    assert torch.equal(torch.cat([f.ids for f in forwards]), torch.tensor([*range(100, 125), 7]))
