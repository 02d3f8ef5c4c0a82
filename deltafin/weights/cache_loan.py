"""A prompt's forward borrows the expert store's cache (plan/memory/sizing.py `_lend_cache`; runtime/stage.py asks): the
warming stops, the reads settle, the cache empties and the memory of its slots goes back to the system but for
those the forward leaves, which read the next experts ahead; decode takes the cache back, empty, and it refills as
after a start. Only between forwards: every slot is free while its memory changes (expert_slots.py)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the store these methods are part of
    from deltafin.weights.expert_cache import ExpertCache
    from deltafin.weights.expert_heat import ExpertHeat, Warmer
    from deltafin.weights.expert_reads import ExpertReads
    from deltafin.weights.expert_slots import ExpertSlots, Key, Loaded

log = logging.getLogger(__name__)


class CacheLoan:
    """The lending half of the expert store (weights/store.py's ExpertStore)."""

    slots: ExpertSlots
    cache: ExpertCache[Key, Loaded]
    reads: ExpertReads
    heat: ExpertHeat | None
    warmer: Warmer | None
    layers: set[int]
    slot_bytes: int
    read_threads: int
    _lock: threading.RLock

    def lend_cache(self, keep: int = 0) -> None:
        """A prompt's forward longer than the plan's borrows the cache (plan/memory/sizing.py `_lend_cache`): the
        warming stops, the reads settle, the cache empties and the memory of all but `keep` of its slots goes back to
        the
        system; those `keep` read the next experts ahead (`prefetch`). Between forwards only."""
        keep = min(keep, self.slots.cache_slots - 1)  # (all of them kept: not lent)
        if self.slots.cache_slots and self.slots.kept != keep:
            self._quiesce()
            self.slots.lend_cache(keep)
            self.cache.budget = 0
            log.debug("expert store: its cache lent to a prompt's forward, %d slots kept to read ahead", keep)

    def take_back_cache(self) -> None:
        """Decode takes the cache back, empty: it fills as layers use experts and, as after a start, with the
        remembered heat's hottest experts read behind every other read."""
        if self.slots.lent:
            self._quiesce()
            self.slots.take_back()
            self.cache.budget = self.slots.cache_slots * self.slot_bytes
            if self.heat is not None:
                self.warmer = self.heat.warm(self.reads, self.cache, self.layers, self.slot_bytes, self.read_threads)

    def _quiesce(self) -> None:
        """No read in flight, nothing staged or cached: every slot free."""
        if self.warmer is not None:
            self.warmer.close()
        for loaded in self.reads.settle():
            self.slots.release(loaded)
        with self._lock:
            self.cache.clear()
