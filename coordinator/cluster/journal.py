"""The replay journal: for every live session and kept prefix, the token ids fed to stage 0 and their chunks.

A `Record` holds one session's inputs in the order and chunks they were fed (prompt, then one token per step,
speculative forwards marked): 4 bytes per token plus 4 per forward. The `ReplayJournal` keeps the records of the
live sessions and of the kept prefixes, their size in tokens, and which sessions must be replayed before their
next forward (stale). It holds at most `budget` tokens in all: the least recently used sessions lose their record
first, and would fail rather than recover; kept prefixes' records go before any live session's. A session
resumed from a kept prefix starts with that prefix's record, so it too replays from token 0.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from deltafin.runtime.stage_io import SeqInput

log = logging.getLogger(__name__)


@dataclass
class Record:
    ids: array = field(default_factory=lambda: array("i"))  # every token fed to stage 0, in order
    chunks: array = field(default_factory=lambda: array("i"))  # the length of each forward that fed them
    starts: array = field(default_factory=lambda: array("i"))  # the cache_len each forward continued from
    speculative: array = field(default_factory=lambda: array("b"))  # whether it was (the next may rewind)

    def copy(self) -> Record:
        return Record(array("i", self.ids), array("i", self.chunks), array("i", self.starts),
                      array("b", self.speculative))

    def upto(self, tokens: int) -> Record:
        """The record of the session's first `tokens` tokens (a prefix kept inside a forward): the forwards
        before that point, the one it falls in cut there."""
        out = Record()
        for n, start, spec in zip(self.chunks, self.starts, self.speculative, strict=True):
            if start >= tokens:
                break
            take = min(n, tokens - start)
            out.chunks.append(take)
            out.starts.append(start)
            out.speculative.append(spec)
        out.ids = array("i", self.ids[:out.end])
        return out

    @property
    def end(self) -> int:
        return self.starts[-1] + self.chunks[-1] if self.chunks else 0

    def continues(self, cache_len: int) -> bool:
        """Whether a forward from `cache_len` follows what is recorded: from its end, or from a position of
        the last forward if that was speculative (the stages rewind there)."""
        if cache_len == self.end:
            return True
        return bool(self.chunks) and bool(self.speculative[-1]) and self.starts[-1] < cache_len <= self.end

    def add(self, item: SeqInput) -> None:
        self.ids.extend(int(t) for t in item.ids.tolist())  # type: ignore[union-attr]
        self.chunks.append(item.num_tokens)
        self.starts.append(item.cache_len)
        self.speculative.append(item.speculative)

    def forwards(self) -> list[SeqInput]:
        """The recorded forwards again, for a session id filled in by the caller."""
        out, pos = [], 0
        for n, start, spec in zip(self.chunks, self.starts, self.speculative, strict=True):
            out.append(SeqInput("", start, ids=torch.tensor(self.ids[pos:pos + n], dtype=torch.long),
                                speculative=bool(spec)))
            pos += n
        return out


class ReplayJournal:
    """The records of live sessions and kept prefixes, within `budget` tokens (see the module docstring)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.sessions: OrderedDict[str, Record] = OrderedDict()  # least recently used first
        self.prefixes: OrderedDict[str, Record] = OrderedDict()  # kept prefixes: how their state was fed
        self.size = 0  # tokens in all the records
        self.stale: set[str] = set()  # sessions to replay before their next forward

    def record(self, batch: list[SeqInput]) -> None:
        """Add a forward that succeeded; then lose the oldest records until the journal fits its budget."""
        for item in batch:
            if item.ids is None:
                continue
            if item.cache_len == 0:
                self.forget(item.session_id)
            if item.resume_from and item.session_id not in self.sessions:
                kept = self.prefixes.get(item.resume_from)
                if kept is not None:  # a resumed session replays from token 0 the way its prefix was fed
                    self.sessions[item.session_id] = kept.copy()
                    self.size += len(kept.ids)
            j = self.sessions.setdefault(item.session_id, Record())
            if not j.continues(item.cache_len):  # not a continuation of what was recorded: cannot replay it
                self.forget(item.session_id)
                continue
            j.add(item)
            self.size += item.num_tokens
            self.sessions.move_to_end(item.session_id)
            for n, prefix_id in item.save_at:
                kept = j.copy() if n == j.end else j.upto(n)
                self.prefixes[prefix_id] = kept
                self.size += len(kept.ids)
        self._evict()

    def know_prefix(self, prefix_id: str, tokens: list[int], chunk: int | None) -> None:
        """A kept prefix a request resumes from, fed as `tokens` in forwards of `chunk` tokens if it has no record
        (the stages kept it before this journal existed): so that a session resumed from it can be replayed."""
        if prefix_id in self.prefixes or not tokens:
            return
        step = chunk or len(tokens)
        record = Record(array("i", tokens))
        for start in range(0, len(tokens), step):
            record.chunks.append(min(step, len(tokens) - start))
            record.starts.append(start)
            record.speculative.append(False)
        self.prefixes[prefix_id] = record
        self.size += len(tokens)
        self._evict()

    def _evict(self) -> None:
        while self.size > self.budget and self.prefixes:
            self.forget_prefix(next(iter(self.prefixes)))
        while self.size > self.budget and len(self.sessions) > 1:
            sid, _ = next(iter(self.sessions.items()))
            log.warning("session %s no longer fits the replay journal; it cannot survive a worker loss", sid[:8])
            self.forget(sid)

    def release(self, sid: str, keep_as: str) -> None:
        """A session ends: its record becomes the record of the prefix it is kept as (`keep_as`), or goes; a
        released id that names a kept prefix drops that prefix's record."""
        j = self.sessions.get(sid)
        if keep_as and j is not None:  # the kept prefix is rebuilt the way the session was
            self.sessions.pop(sid)
            self.stale.discard(sid)
            self.prefixes[keep_as] = j
        else:
            self.forget(sid)
            self.forget_prefix(sid)

    def forget(self, sid: str) -> None:
        j = self.sessions.pop(sid, None)
        if j is not None:
            self.size -= len(j.ids)
        self.stale.discard(sid)

    def forget_prefix(self, prefix_id: str) -> None:
        j = self.prefixes.pop(prefix_id, None)
        if j is not None:
            self.size -= len(j.ids)

    def mark_stale(self, sids: Iterable[str]) -> None:
        """Replay these sessions (those with a record) before their next forward."""
        self.stale.update(s for s in sids if s in self.sessions)

    def mark_all_stale(self) -> None:
        """Replay every recorded session before its next forward (the stages were planned again)."""
        self.mark_stale(self.sessions)
