"""The expert store's reads in flight and its prefetcher: guesses of the experts a layer will need, read behind
every demand read, and staged once read until their layer uses them; demand reads for the experts a layer needs
now; and who owns each expert as its read lands. A guess is dropped when a newer guess or the layer's real choice
no longer wants it: cancelled if still queued, stopped between pieces if running. A read another compute thread
waits for is a demand, which nothing drops. And the start's warming reads (expert_heat.py), behind all of those, which
`keep` puts in the cache as they land; one a layer asks for meanwhile becomes that layer's demand, read once.

Every method runs under the store's lock but `landed`, `take` and `abandon`, which take it themselves (a read's
future calls `landed` in its reader thread, or at once where it is already done)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Container
from concurrent.futures import Future

from deltafin.weights.expert_disks import ExpertDisks
from deltafin.weights.expert_slots import Key, Loaded
from deltafin.weights.expert_stats import ExpertStats
from deltafin.weights.mlx_slots import MLXSlotPool
from deltafin.weights.reader import DEMAND, PREFETCH, WARM, ReadAborted, ReadPlan, SlotPool


class ExpertReads:
    """Reads of experts from `disks` into `pool`'s slots; `deliver(slot, plan, layer)` turns a filled slot into the
    expert (in the reader thread), `release` frees the slot of an expert nobody will use."""

    def __init__(self, lock: threading.RLock, disks: ExpertDisks, pool: SlotPool | MLXSlotPool, stats: ExpertStats,
                 deliver: Callable[[int, ReadPlan, int], Loaded], release: Callable[[Loaded], None]):
        self.lock, self.disks, self.pool, self.stats = lock, disks, pool, stats
        self.deliver, self.release = deliver, release
        self.pending: dict[Key, tuple[Future, int]] = {}  # in flight: (future, priority)
        self.staged: dict[Key, Loaded] = {}  # prefetched, read, not yet used
        self.abandon_flags: dict[Future, threading.Event] = {}  # running prefetches that may be stopped
        self.keep: Callable[[Key, Loaded], bool] | None = None  # the warming's: a landed warming read into the cache
        self.live: set[Future] = set()  # every read submitted and not landed yet, dropped guesses too
        self.idle = threading.Condition(lock)  # told when `live` empties

    def submit(self, key: Key, priority: int) -> Future:
        # earlier layers first, and within a layer demand before prefetch; a prefetch can be abandoned
        abandon = threading.Event() if priority == PREFETCH else None
        fut = self.disks.submit(key, priority, self.pool,
                                lambda slot, plan, layer=key[0]: self.deliver(slot, plan, layer),
                                abandon.is_set if abandon is not None else None)
        if abandon is not None:
            self.abandon_flags[fut] = abandon
        self.pending[key] = (fut, priority)
        self.live.add(fut)
        fut.add_done_callback(lambda f, key=key: self.landed(key, f))
        return fut

    def guess(self, layer: int, ids: list[int], cached: Container[Key], most: int) -> None:
        """Prefetch a layer's likely experts, most likely first, at most `most` reads and staged guesses in all; a
        new guess for a layer replaces the previous one."""
        self.drop_guesses(layer, set(ids))
        for e in ids:
            key = (layer, e)
            if key in self.pending or key in self.staged or key in cached:
                continue
            if len(self.staged) + self.reading() >= most:
                break  # bounded: two layers' guesses, so a layer's own k reads always find slots
            self.submit(key, PREFETCH)
            self.stats.prefetch_issued += 1
            self.stats.prefetch_bytes += self.disks.nbytes(key)

    def warm(self, key: Key, cached: Container[Key]) -> Future | None:
        """Read an expert for the cache before anything asks for it (the start's warming), behind every other read;
        None where it is cached, staged or being read already."""
        if key in self.pending or key in self.staged or key in cached:
            return None
        return self.submit(key, WARM)

    def reading(self) -> int:
        """Demand reads and guesses in flight (the warming's reads aside): while there are any, warming waits."""
        return sum(1 for _, priority in self.pending.values() if priority != WARM)

    def drop_guesses(self, layer: int, wanted: set[int]) -> None:
        """Drop the layer's prefetches of experts not `wanted`."""
        for key, (fut, priority) in list(self.pending.items()):
            if key[0] == layer and key[1] not in wanted and priority == PREFETCH:
                self.drop_guess(key, fut)

    def drop_guess(self, key: Key, fut: Future) -> None:
        """A prefetch no longer wanted: cancel it if queued, stop it between pieces if running. Either way it
        leaves `pending` now, so a later request for the expert starts a read of its own."""
        if fut.cancel():
            self.stats.prefetch_cancelled += 1
        else:
            flag = self.abandon_flags.get(fut)
            if flag is None or fut.done():
                return  # landed meanwhile: it is staged and settled like any prefetch
            flag.set()  # stops between pieces; if it finishes anyway, `landed` frees it as waste
            self.stats.prefetch_cancelled += 1
        if self.pending.get(key, (None,))[0] is fut:
            del self.pending[key]

    def demand(self, key: Key) -> Future:
        """The read of an expert a layer needs now and nobody has staged or cached."""
        fut, priority = self.pending.get(key, (None, None))
        if fut is not None and priority in (PREFETCH, WARM) and fut.cancel():
            fut = None  # still queued behind other prefetches (or warming reads): read it now instead
        if fut is None:
            self.stats.misses += 1
            return self.submit(key, DEMAND)
        if priority == WARM:  # a warming read being read: the layer waits for the disk as for a read of its own
            self.stats.misses += 1
        else:  # a guess being read: it is a demand now, which no newer guess may drop
            self.stats.prefetch_hits += 1
        self.pending[key] = (fut, DEMAND)
        self.abandon_flags.pop(fut, None)
        return fut

    def landed(self, key: Key, fut: Future) -> None:
        """A read finished (in its reader thread). Who owns the expert now:
        - a demand read: the compute thread waiting for it (it claims it in `take`, or `abandon` frees it);
        - a prefetch still wanted: `staged`, unless the compute thread claimed it first;
        - a warming read nobody asked for: the cache, through `keep`, where it still has room (else freed);
        - a prefetch dropped meanwhile: nobody, so its slot is freed here."""
        with self.lock:
            try:
                self._landed(key, fut)
            finally:
                self.live.discard(fut)
                if not self.live:
                    self.idle.notify_all()

    def _landed(self, key: Key, fut: Future) -> None:
        self.abandon_flags.pop(fut, None)
        current = self.pending.get(key)
        is_current = current is not None and current[0] is fut
        if is_current:
            del self.pending[key]
        if fut.cancelled() or fut.exception() is not None:
            return  # the worker freed the slot of a failed read
        loaded: Loaded = fut.result()
        if loaded.claimed:
            return
        if is_current and current[1] == PREFETCH:
            self.staged[key] = loaded
        elif is_current and current[1] == WARM:
            if self.keep is None or not self.keep(key, loaded):
                self.release(loaded)  # the cache filled meanwhile: nothing asked for it, so it is not waste
        elif not is_current:
            self.stats.wasted_bytes += self.disks.nbytes(key)
            self.release(loaded)

    def settle(self) -> list[Loaded]:
        """Every read still queued cancelled, every guess running stopped, every read in flight landed (an abandoned
        layer's too): what is staged, handed over (its slots the caller's to free). Only while no compute thread
        uses the store (its slots are about to change)."""
        with self.lock:
            for key, (fut, _) in list(self.pending.items()):
                if not fut.cancel():
                    self.abandon_flags.get(fut, threading.Event()).set()
                del self.pending[key]
            while self.live:
                self.idle.wait()
            staged, self.staged = list(self.staged.values()), {}
        return staged

    def take(self, key: Key, fut: Future) -> Loaded:
        """The expert of a read the compute thread waited for, claimed (a prefetch may be staged by now)."""
        try:
            result = fut.result()
        except ReadAborted:  # a guess stopped just as it became needed: read it now
            with self.lock:
                retry = self.submit(key, DEMAND)
            result = retry.result()
        with self.lock:
            if self.staged.get(key) is result:
                del self.staged[key]
            result.claimed = True
        return result

    def abandon(self, key: Key, fut: Future) -> None:
        """A read nobody waits for any more (its layer failed): free its slot unless staged or claimed."""
        if fut.cancelled() or fut.exception() is not None:
            return
        with self.lock:
            loaded: Loaded = fut.result()
            if loaded.claimed or self.staged.get(key) is loaded:
                return
            loaded.claimed = True
        self.release(loaded)
