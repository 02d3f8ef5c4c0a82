"""A stage's prefix cache: sequence state kept after its request, so that the next request sharing the
token prefix resumes from it instead of prefilling again.

An entry is the state of a session's layers on this stage at some token count, under an id the coordinator
chose (it maps token prefixes to ids: coordinator/prefix.py). Entries come from a session that is released
with `keep_as` (the state moves, nothing is copied) or from a forward that asks to `save_as` (the live
session's tensors are shared; see models/cache.py for why that is safe). The store is an LRU within a
byte budget: a new entry evicts the least recently used ones, and one larger than the whole budget is not
kept. Every stage keeps its own part under the same id; a stage that has lost an entry says so
(PrefixNotFound) and the coordinator prefills from the start instead.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from deltafin.models.cache import SequenceCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixBudget:
    """What a stage keeps prefixes within: its layers, its prefix bytes, its activations' element size (MLA
    latents are stored in it). The coordinator's index accounts for every stage from these."""

    start: int
    end: int
    budget: int
    act_bytes: int


@dataclass
class PrefixStats:
    kept: int = 0  # entries stored
    resumed: int = 0  # sessions started from an entry
    evicted: int = 0  # entries dropped for room
    refused: int = 0  # entries larger than the whole budget


class PrefixStore:
    def __init__(self, budget: int):
        self.budget = budget
        self.entries: OrderedDict[str, SequenceCache] = OrderedDict()
        self.stats = PrefixStats()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.entries.values())

    def keep(self, prefix_id: str, state: SequenceCache) -> bool:
        """Store `state` under `prefix_id` (replacing an entry of that id); False if it can never fit."""
        self.entries.pop(prefix_id, None)
        size = state.nbytes
        if size > self.budget:
            self.stats.refused += 1
            return False
        while self.entries and self.nbytes + size > self.budget:
            old, _ = self.entries.popitem(last=False)
            self.stats.evicted += 1
            log.debug("prefix %s evicted for room", old[:8])
        self.entries[prefix_id] = state
        self.stats.kept += 1
        return True

    def get(self, prefix_id: str) -> SequenceCache | None:
        state = self.entries.get(prefix_id)
        if state is not None:
            self.entries.move_to_end(prefix_id)
        return state

    def drop(self, prefix_id: str) -> bool:
        return self.entries.pop(prefix_id, None) is not None

    def clear(self) -> None:
        self.entries.clear()

    def as_dict(self) -> dict[str, int]:
        return {"prefixes": len(self.entries), "prefix_bytes": self.nbytes, "prefix_budget": self.budget,
                "prefixes_kept": self.stats.kept, "prefixes_resumed": self.stats.resumed,
                "prefixes_evicted": self.stats.evicted, "prefixes_refused": self.stats.refused}
