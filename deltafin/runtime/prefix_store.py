"""A stage's prefix cache: sequence state kept after its request, so that the next request sharing the
token prefix resumes from it instead of prefilling again.

An entry is the state of a session's layers on this stage at some token count, under an id the coordinator
chose (it maps token prefixes to ids: coordinator/engine/prefix_index.py). Entries come from a session that is released
with `keep_as` (the state moves, nothing is copied) or from a forward that asks to `save_at` (at its end the live
session's tensors are shared, see models/cache.py for why that is safe; inside it the states taken as it ran).
The last stage keeps a kept prompt's last logits with it. The store is an LRU within a
byte budget: a new entry evicts the least recently used ones, and one larger than the whole budget is not
kept. Every stage keeps its own part under the same id; a stage that has lost an entry says so
(PrefixNotFound) and the coordinator prefills from the start instead.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from deltafin.models.cache import SequenceCache
from deltafin.runtime.prefix_disk import PrefixDisk
from deltafin.runtime.worker_stats import StageStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixBudget:
    """What a stage keeps prefixes within: its layers, its prefix bytes (memory, and disk), its activations'
    element size (MLA latents are stored in it), its planned context. The coordinator's index accounts for every
    stage from these."""

    start: int
    end: int
    budget: int
    act_bytes: int
    disk: int = 0  # where the stage keeps them on its disk too: what they may take there
    context: int = 4096  # the tokens a sequence was planned for (the grid of kept states: sizing.prefix_grid)
    identity: str = ""  # what its kept states' numbers depend on (stage_build.state_identity)


@dataclass(frozen=True)
class HeldPrefixes:
    """A stage's answer to "which of these kept prefixes do you hold": each held id's token count, and (the last
    stage's, when asked for one) a kept prompt's last logits."""

    lengths: dict[str, int]
    logits: torch.Tensor | None = None


@dataclass
class PrefixStats:
    kept: int = 0  # entries stored
    resumed: int = 0  # sessions started from an entry
    evicted: int = 0  # entries dropped for room
    refused: int = 0  # entries larger than the whole budget
    restored: int = 0  # entries read back from the disk


class PrefixStore:
    """See the module docstring. With `disk`, every kept entry is also written to the stage's disk (once, in the
    background), stays there when memory evicts it, and is read back on a miss: after a restart too."""

    def __init__(self, budget: int, disk: PrefixDisk | None = None):
        self.budget, self.disk = budget, disk
        self.entries: OrderedDict[str, SequenceCache] = OrderedDict()
        self.tokens: dict[str, array] = {}  # the first stage's: the token ids each kept state has seen
        self.stats = PrefixStats()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.entries.values())

    def keep(self, prefix_id: str, state: SequenceCache, tokens: Sequence[int] | None = None) -> bool:
        """Store `state` under `prefix_id` (replacing an entry of that id); False if it can never fit (in memory
        nor on disk). `tokens`: on the first stage, the token ids the state has seen (so that a restarted
        coordinator can find it again: `find`)."""
        self.entries.pop(prefix_id, None)
        if tokens is not None:
            self.tokens[prefix_id] = array("i", tokens)
        if self.disk is not None:
            self.disk.write(prefix_id, state, tokens)
        size = state.nbytes
        if size > self.budget:
            self.stats.refused += 1
            return self.disk is not None
        while self.entries and self.nbytes + size > self.budget:
            old, _ = self.entries.popitem(last=False)
            self.stats.evicted += 1
            log.debug("prefix %s evicted for room%s", old[:8], " (it stays on the disk)" if self.disk else "")
        self.entries[prefix_id] = state
        self.stats.kept += 1
        return True

    def get(self, prefix_id: str, dtype: torch.dtype = torch.float32) -> SequenceCache | None:
        state = self.entries.get(prefix_id)
        if state is not None:
            self.entries.move_to_end(prefix_id)
            return state
        if self.disk is None:
            return None
        state = self.disk.read(prefix_id, dtype)
        if state is not None:
            self.stats.restored += 1
            tokens = self.disk.tokens(prefix_id)
            if tokens is not None:
                self.tokens[prefix_id] = tokens
        return state

    def held(self, prefix_ids: Sequence[str]) -> dict[str, int]:
        """Which of `prefix_ids` this stage holds, in memory or on disk, with the tokens each holds."""
        out = {}
        for pid in prefix_ids:
            state = self.entries.get(pid)
            length = state.length if state is not None else self.disk.length_of(pid) if self.disk is not None else None
            if length is not None:
                out[pid] = length
        return out

    def logits(self, prefix_id: str) -> torch.Tensor | None:
        """A kept prompt's last logits (the last stage keeps them with its state), or None."""
        state = self.get(prefix_id)
        return None if state is None else state.logits

    def tokens_of(self, prefix_id: str) -> array | None:
        return self.tokens.get(prefix_id)

    def find(self, tokens: Sequence[int]) -> tuple[str, int] | None:
        """The longest kept prefix of `tokens` whose token ids this (first) stage knows, in memory or on disk:
        (id, length)."""
        want, best = array("i", tokens), None
        for pid, t in self.tokens.items():
            if pid in self.entries and len(t) <= len(want) and (best is None or len(t) > best[1]) \
                    and t == want[:len(t)]:
                best = (pid, len(t))
        found = self.disk.find(tokens) if self.disk is not None else None
        return found if found is not None and (best is None or found[1] > best[1]) else best

    def drop(self, prefix_id: str) -> bool:
        self.tokens.pop(prefix_id, None)
        on_disk = self.disk.drop(prefix_id) if self.disk is not None else False
        return self.entries.pop(prefix_id, None) is not None or on_disk

    def clear(self) -> None:
        """Forget what memory holds (the disk keeps its files for the next run)."""
        self.entries.clear()
        self.tokens.clear()

    def close(self) -> None:
        self.clear()
        if self.disk is not None:
            self.disk.close()

    def report(self, stats: StageStats) -> StageStats:
        """`stats` with this store's counters: entries, bytes and budget in memory and on the disk, and what
        happened to them."""
        c = self.stats
        return replace(stats, prefixes=len(self.entries), prefix_bytes=self.nbytes, prefix_budget=self.budget,
                       prefixes_kept=c.kept, prefixes_resumed=c.resumed, prefixes_evicted=c.evicted,
                       prefixes_refused=c.refused, prefixes_restored=c.restored,
                       prefix_disk_files=len(self.disk.files) if self.disk is not None else 0,
                       prefix_disk_bytes=self.disk.nbytes if self.disk is not None else 0)
