"""A stage's session table: each session's caches under its id, within the stage's byte budget for them.

A call with cache_len 0 starts a session (or, with `resume_from`, continues a kept prefix of the stage's
PrefixStore); a later call continues it at the length it names, rewinding to a position of its last
speculative forward if it names one. Room is made by evicting the least recently used sessions not in the
call, and a session that was evicted or expired is named with why when it is asked for again. Sessions end by
explicit release (optionally kept as a prefix), by idle expiry, or by eviction. The first stage also records
each session's token ids, so that a prefix kept from it can be found by its tokens.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

import torch

from deltafin.checkpoint.config import LayerKind, ModelConfig
from deltafin.errors import InvalidInput, OutOfMemory, PrefixNotFound, SessionNotFound, SessionOutOfSync
from deltafin.models.cache import SequenceCache, new_sequence_cache
from deltafin.models.kda import delta_rule_recurrent
from deltafin.plan.memory.stage_parts import sequence_bytes
from deltafin.runtime.prefix_store import PrefixStore

log = logging.getLogger(__name__)

EVICTED_KEPT = 4096  # evicted or expired ids remembered, with why, for a clear error later



class Opening(Protocol):
    """What opening a forward's session takes from its sequence (runtime/stage.py SeqInput)."""

    session_id: str
    cache_len: int
    resume_from: str | None
    speculative: bool
    save_at: tuple[tuple[int, str], ...]

    @property
    def num_tokens(self) -> int: ...

class Sessions(Mapping[str, SequenceCache]):
    """The sessions of the layers `layers`, by id, least recently used first (read as a mapping to their
    caches). `budget`: the bytes their caches may take (None: no limit); `first`: the first stage, which
    records token ids."""

    def __init__(self, cfg: ModelConfig, layers: range, device: torch.device, dtype: torch.dtype,
                 budget: int | None, prefixes: PrefixStore, *, first: bool) -> None:
        self.cfg, self.layers, self.device, self.dtype = cfg, layers, device, dtype
        self.budget, self.prefixes, self.first = budget, prefixes, first
        self.caches: OrderedDict[str, SequenceCache] = OrderedDict()
        self.evicted: OrderedDict[str, str] = OrderedDict()  # session id -> why, for a clear error later
        self.last_used: dict[str, float] = {}  # session id -> monotonic time of its last forward
        self.tokens: dict[str, array] = {}  # the first stage's: session id -> the token ids it has seen

    def __getitem__(self, session_id: str) -> SequenceCache:
        return self.caches[session_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self.caches)

    def __len__(self) -> int:
        return len(self.caches)

    @property
    def nbytes(self) -> int:
        """What the sessions hold against their budget: caches, and a speculative forward's trail until the next
        forward picks the position (planned room with `speculative_tokens`, else taken from the caches' room)."""
        return sum(c.nbytes + c.trail_bytes for c in self.caches.values())

    def open_forward(self, batch: Sequence[Opening]) -> list[SequenceCache]:
        """Each sequence's session as `open` gives it, snapshotted (a failed forward restores it), marked where
        `save_at` asks inside the forward, with a trail to rewind where it is speculative."""
        pinned = {b.session_id for b in batch}
        caches = [self.open(b.session_id, b.cache_len, b.num_tokens, pinned, b.resume_from) for b in batch]
        for c, item in zip(caches, batch, strict=True):
            c.snapshot()
            if item.speculative:
                c.start_trail()
            inside = [n - item.cache_len for n, _ in item.save_at if n < item.cache_len + item.num_tokens]
            if inside:
                c.mark(inside)
        return caches

    def open(self, session_id: str, cache_len: int, num_tokens: int, pinned: set[str],
             resume_from: str | None = None) -> SequenceCache:
        """The caches a forward of `num_tokens` tokens continues at `cache_len` (0: a new session, or one resumed
        from the prefix `resume_from`), with room made for it; sessions in `pinned` (the call's) stay."""
        sid = session_id
        if cache_len == 0:
            self.caches.pop(sid, None)
            self.evicted.pop(sid, None)
            self._make_room(sequence_bytes(self.cfg, self._count(LayerKind.KDA), self._count(LayerKind.MLA),
                                           num_tokens, torch.finfo(self.dtype).bits // 8), pinned)
            cache = new_sequence_cache(self.cfg, self.layers, self.device, self.dtype, num_tokens)
            self.caches[sid] = cache
            self.last_used[sid] = time.monotonic()
            return cache
        cache = self.caches.get(sid)
        if cache is None and resume_from:
            cache = self._resume(sid, cache_len, num_tokens, resume_from, pinned)
        if cache is None:
            why = self.evicted.get(sid)
            raise SessionNotFound(f"session {sid!r} is not on this stage"
                                  + (f" ({why})" if why else "") + "; start it again with cache_len 0")
        if (cache.pending or cache.length != cache_len) and not cache.rewind(cache_len, delta_rule_recurrent):
            raise SessionOutOfSync(f"session {sid!r}: this stage holds {cache.length} tokens but the call says "
                                   f"{cache_len} (a replayed or concurrent call?)")
        self.caches.move_to_end(sid)
        self.last_used[sid] = time.monotonic()
        self._make_room(cache.growth(num_tokens), pinned)
        return cache

    def _resume(self, session_id: str, cache_len: int, num_tokens: int, prefix_id: str,
                pinned: set[str]) -> SequenceCache:
        """A new session from a kept prefix of exactly cache_len tokens."""
        kept = self.prefixes.get(prefix_id, self.dtype)
        if kept is None:
            raise PrefixNotFound(f"prefix {prefix_id!r} is not on stage [{self.layers.start}, {self.layers.stop}) "
                                 "(evicted or never kept); start the session with cache_len 0")
        if kept.length != cache_len:
            raise InvalidInput(f"prefix {prefix_id!r} holds {kept.length} tokens, not {cache_len}")
        self._make_room(kept.resume_bytes(num_tokens), pinned)
        cache = kept.resume(num_tokens)
        self.caches[session_id] = cache
        known = self.prefixes.tokens_of(prefix_id) if self.first else None
        if known is not None:
            self.tokens[session_id] = array("i", known)
        self.evicted.pop(session_id, None)
        self.prefixes.stats.resumed += 1
        return cache

    def _count(self, kind: LayerKind) -> int:
        return sum(1 for i in self.layers if self.cfg.layer_kinds[i] is kind)

    def _make_room(self, need: int, pinned: set[str]) -> None:
        """Evict least-recently-used sessions (not in this call) until `need` more bytes fit the budget."""
        if self.budget is None:
            return
        for sid in list(self.caches):
            if self.nbytes + need <= self.budget:
                return
            if sid in pinned:
                continue
            self.caches.pop(sid)
            self.last_used.pop(sid, None)
            self.tokens.pop(sid, None)
            self._note_evicted(sid, f"evicted to make room: the stage cache budget is {self.budget / 1e9:.2f} GB")
            log.info("evicted session %s", sid)
        if self.nbytes + need > self.budget:
            raise OutOfMemory(f"the session cache budget ({self.budget / 1e9:.3f} GB) cannot hold this "
                              f"request's sequences ({(self.nbytes + need) / 1e9:.3f} GB)")

    def _note_evicted(self, sid: str, why: str) -> None:
        self.evicted[sid] = why
        while len(self.evicted) > EVICTED_KEPT:
            self.evicted.popitem(last=False)

    def record_tokens(self, session_id: str, cache_len: int, ids: torch.Tensor | None) -> array | None:
        """The first stage's record of a session's token ids, continued from where the forward started."""
        if not self.first:
            return None
        tokens = self.tokens.setdefault(session_id, array("i")) if cache_len == 0 or session_id in \
            self.tokens else None
        if tokens is None:  # resumed from a prefix whose tokens this stage never knew
            return None
        del tokens[cache_len:]
        tokens.extend(int(t) for t in ids.tolist())  # type: ignore[union-attr]
        return tokens

    def release(self, session_id: str, keep_as: str | None = None, keep_length: int = 0) -> bool:
        """Free a session's caches, or with `keep_as` turn them into that prefix (nothing is copied), of its
        first `keep_length` tokens if given (a position of its last speculative forward); an id that names a
        prefix instead drops it. False if neither existed."""
        self.evicted.pop(session_id, None)
        self.last_used.pop(session_id, None)
        tokens = self.tokens.pop(session_id, None)
        cache = self.caches.pop(session_id, None)
        if cache is None:
            return self.prefixes.drop(session_id)
        if keep_as and (cache.pending or keep_length and keep_length != cache.length) \
                and not cache.rewind(keep_length or cache.length, delta_rule_recurrent):
            log.warning("session %s holds %d tokens and cannot be kept as %d of them: not kept", session_id[:8],
                        cache.length, keep_length)
            return True
        if keep_as:
            cache.forget_snapshot()
            self.prefixes.keep(keep_as, cache, tokens[:cache.length] if tokens is not None else None)
        return True

    def expire(self, idle_seconds: float, now: float | None = None) -> list[str]:
        """Drop sessions unused for `idle_seconds` (a coordinator that vanished never releases them)."""
        now = time.monotonic() if now is None else now
        gone = [sid for sid, t in self.last_used.items() if now - t > idle_seconds]
        for sid in gone:
            self.caches.pop(sid, None)
            self.last_used.pop(sid, None)
            self.tokens.pop(sid, None)
            self._note_evicted(sid, f"expired after {idle_seconds:.0f}s without use")
        return gone

    def close(self) -> None:
        """Drop every session's caches, token ids and times (what was evicted is still named)."""
        self.caches.clear()
        self.tokens.clear()
        self.last_used.clear()
