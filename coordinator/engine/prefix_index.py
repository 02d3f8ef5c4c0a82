"""The coordinator's half of the prefix cache: which token prefixes the stages hold state for.

Every stage keeps its layers' part of a prefix under one id (deltafin/runtime/prefix_store.py): the hash of the
prefix's exact token ids (`prefix_id`), so a stage never resumes a state under tokens it did not see, and a
coordinator that restarted can name what the stages kept before. This index maps token sequences to those ids
and decides what is kept:
- while a prompt prefills, at its keep points: the end of each chat message (system prompt, tool list, turns),
  each explicit cache breakpoint (Anthropic's `cache_control`), a grid inside long messages (every `grid`
  tokens from the prompt's start: plan/sizing.prefix_grid), and the prompt's end, with the last position's
  logits on the last stage, so that an identical prompt feeds no token at all;
- when a request finishes: every token fed (the prompt and all but the last generated token), so that the
  next turn of a chat resumes after the reply.
A request resumes from the longest indexed prefix of its prompt that every stage still holds (asked before
the request starts: Backend.held_prefixes), its KDA states exactly the prefix's, its MLA latents the prefix's
rows. A prompt kept whole resumes whole when the last stage still has its logits; otherwise from a shorter one.

The index does the stages' byte accounting itself, from each stage's capacity for kept prefixes (its memory
budget, or its disk budget where it keeps them on disk too) and the exact size of a kept state
(stage_parts.sequence_bytes), and evicts before any stage would have to: prefixes that no request has resumed twice
go first, least recently used first, then shared ones (a system prompt many conversations start with is kept
longest). Evicted ids are dropped on the stages.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import torch

from deltafin.checkpoint.config import LayerKind, ModelConfig
from deltafin.plan.memory.kept_prefixes import prefix_grid
from deltafin.plan.memory.stage_parts import sequence_bytes
from deltafin.runtime.prefix_store import HeldPrefixes, PrefixBudget

SHARED_HITS = 2  # an entry resumed this often is shared: evicted only after every unshared one


def prefix_id(tokens: Sequence[int]) -> str:
    """A kept prefix's id: the hash of its exact token ids (int32, as the wire carries them)."""
    return ids_along(tokens, [len(tokens)])[len(tokens)]


def ids_along(tokens: Sequence[int], lengths: Sequence[int]) -> dict[int, str]:
    """The ids of `tokens`' prefixes of these lengths, hashed in one pass."""
    want, out, at = array("i", tokens), {}, 0
    h = hashlib.blake2b(digest_size=16, person=b"deltafin-prefix")
    for n in sorted(set(lengths)):
        h.update(want[at:n].tobytes())  # little-endian: the codec refuses any other host
        at = n
        out[n] = h.copy().hexdigest()
    return out


@dataclass(frozen=True)
class StageShare:
    """One stage's part of every prefix: its KDA and MLA layers, the bytes it keeps them in (memory; `disk`
    where it keeps them on its disk too), its latents' element size, the context it was planned for."""

    n_kda: int
    n_mla: int
    budget: int
    act_bytes: int
    disk: int = 0
    context: int = 4096
    identity: str = ""  # what its kept states' numbers depend on: another identity holds none of the index's

    @property
    def capacity(self) -> int:
        return self.disk if self.disk else self.budget


def stage_shares(cfg: ModelConfig, stages: Sequence[PrefixBudget]) -> list[StageShare]:
    out = []
    for s in stages:
        kinds = cfg.layer_kinds[s.start:s.end]
        out.append(StageShare(sum(k is LayerKind.KDA for k in kinds), sum(k is LayerKind.MLA for k in kinds),
                              s.budget, s.act_bytes, s.disk, s.context, s.identity))
    return out


@dataclass
class Entry:
    prefix_id: str
    tokens: array  # the token ids the kept state has seen
    hits: int = 0  # requests that resumed from it

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class PrefixCounters:
    lookups: int = 0
    hits: int = 0
    tokens_saved: int = 0  # prompt tokens not prefilled again
    whole: int = 0  # of the hits, prompts resumed whole (no prompt token fed)
    kept: int = 0
    evicted: int = 0
    missing: int = 0  # indexed, but a stage no longer had it


AskHeld = Callable[[list[str], str | None], Awaitable[HeldPrefixes]]  # Backend.held_prefixes
FindPrefix = Callable[[list[int]], Awaitable[tuple[str, int] | None]]


class PrefixIndex:
    def __init__(self, cfg: ModelConfig, shares: list[StageShare] | None = None):
        self.cfg = cfg
        self.shares = shares or []
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self.pinned: dict[str, int] = {}  # entries a request is about to resume from: never evicted meanwhile
        self.counters = PrefixCounters()
        self.grid = self._grid()

    @property
    def enabled(self) -> bool:
        return bool(self.shares) and all(s.budget > 0 for s in self.shares)

    def reshape(self, shares: list[StageShare]) -> list[str]:
        """The stages changed (a re-plan): their new budgets; entries beyond them are evicted (returned). A stage
        of another identity (another spine format, dtype, device or kernels) holds none of the states indexed:
        every entry goes."""
        before = [(s.n_kda, s.n_mla, s.identity) for s in self.shares]
        self.shares = shares
        self.grid = self._grid()
        if before and before != [(s.n_kda, s.n_mla, s.identity) for s in shares]:
            gone = list(self.entries)
            self.entries.clear()
            self.counters.evicted += len(gone)
            return gone
        return self._evict_for(0) or []

    def _grid(self) -> int:
        if not self.shares:
            return 1 << 62
        return max(prefix_grid(self.cfg, s.n_kda, s.n_mla, s.act_bytes, s.capacity, s.context) for s in self.shares)

    def cost(self, share: StageShare, length: int) -> int:
        return sequence_bytes(self.cfg, share.n_kda, share.n_mla, length, share.act_bytes)

    def used(self, share: StageShare) -> int:
        return sum(self.cost(share, e.length) for e in self.entries.values())

    def fits_inside(self, length: int) -> int:
        """States of `length` tokens one forward may take inside itself: what every stage's memory holds at once
        (they stay in memory until its disk has them), at least one."""
        return max(1, min(s.budget // max(1, self.cost(s, length)) for s in self.shares)) if self.shares else 0

    def matches(self, prompt: Sequence[int]) -> list[Entry]:
        """The entries whose tokens begin `prompt` (the whole prompt included), longest first."""
        want = array("i", prompt)
        found = [e for e in self.entries.values() if e.length <= len(want) and e.tokens == want[:e.length]]
        return sorted(found, key=lambda e: -e.length)

    def hit(self, entry: Entry, whole: bool) -> None:
        self.entries.move_to_end(entry.prefix_id)
        entry.hits += 1
        self.counters.hits += 1
        self.counters.whole += int(whole)
        self.counters.tokens_saved += entry.length

    def reserve(self, tokens: Sequence[int]) -> tuple[str | None, list[str]]:
        """An id to keep the state of `tokens` under, and the ids evicted to make room for it (release them
        on the stages first). None when it could never fit, or an entry already holds exactly these tokens."""
        if not self.enabled or not tokens:
            return None, []
        pid = prefix_id(tokens)
        if pid in self.entries or any(self.cost(s, len(tokens)) > s.capacity for s in self.shares):
            return None, []
        evicted = self._evict_for(len(tokens))
        if evicted is None:
            return None, []
        self.entries[pid] = Entry(pid, array("i", tokens))
        self.counters.kept += 1
        return pid, evicted

    def adopt(self, pid: str, tokens: Sequence[int]) -> list[str] | None:
        """Index a prefix the stages kept before this index existed (a coordinator that restarted) under its
        own id; the ids evicted for its room, or None if it cannot fit."""
        if not self.enabled or pid in self.entries or any(self.cost(s, len(tokens)) > s.capacity
                                                          for s in self.shares):
            return None
        evicted = self._evict_for(len(tokens))
        if evicted is not None:
            self.entries[pid] = Entry(pid, array("i", tokens))
        return evicted

    def _evict_for(self, length: int) -> list[str] | None:
        """Evict until one of `length` tokens fits every stage (0: until the entries fit): unshared entries
        least recently used first, then shared ones; None if it cannot, for the pinned entries (nothing is
        evicted then)."""
        over = lambda: any(self.used(s) + (self.cost(s, length) if length else 0) > s.capacity for s in self.shares)
        order = [e.prefix_id for e in self.entries.values() if e.hits < SHARED_HITS] + \
            [e.prefix_id for e in self.entries.values() if e.hits >= SHARED_HITS]
        victims, kept = [], dict(self.entries)
        for pid in order:
            if not over():
                break
            if pid not in self.pinned:
                victims.append(pid)
                del self.entries[pid]
        if over() and length:
            self.entries = OrderedDict(kept)  # not without a pinned entry: undo
            return None
        self.counters.evicted += len(victims)
        return victims

    def pin(self, pid: str) -> None:
        self.pinned[pid] = self.pinned.get(pid, 0) + 1

    def unpin(self, pid: str) -> None:
        n = self.pinned.pop(pid, 0) - 1
        if n > 0:
            self.pinned[pid] = n

    def drop(self, pid: str) -> None:
        self.entries.pop(pid, None)

    def lost(self, pid: str) -> None:
        """A stage did not have it: forget it."""
        self.counters.missing += 1
        self.drop(pid)


def keep_points(length: int, boundaries: Sequence[int], grid: int, start: int) -> list[int]:
    """Where a prompt of `length` tokens, resumed at `start`, keeps its state: its boundaries (messages' ends,
    breakpoints), the grid's multiples and its end, past `start`."""
    points = {b for b in boundaries if start < b < length} | set(range(grid, length, grid)) | {length}
    return sorted(p for p in points if p > start)


def inside_forward(points: Sequence[int], boundaries: Sequence[int], end: int, limit: int) -> list[int]:
    """Of the keep points inside one forward (before its `end`), the `limit` it takes: explicit boundaries
    before grid points, the earliest first (a system prompt and tool list are what the most conversations
    share)."""
    inside = [p for p in points if p < end]
    explicit = set(boundaries)
    return sorted(sorted(inside, key=lambda p: (p not in explicit, p))[:limit])


ReleaseIds = Callable[[list[str]], Awaitable[None]]


@dataclass
class PrefixSession:
    """One request's use of the index: where it resumes, what it keeps as it goes, what it leaves behind.
    `release_ids` frees evicted prefixes on the stages before the state that needs their room is kept."""

    index: PrefixIndex
    release_ids: ReleaseIds
    prompt: list[int]
    boundaries: tuple[int, ...] = ()
    resumed: Entry | None = None
    logits: torch.Tensor | None = None  # the prompt was kept whole: its last position's logits
    kept: list[str] = field(default_factory=list)
    kept_upto: int = 0  # the longest prefix of the prompt this request keeps
    _unpinned: bool = False

    @classmethod
    async def start(cls, index: PrefixIndex, release_ids: ReleaseIds, prompt: list[int], held: AskHeld,
                    find: FindPrefix | None = None, boundaries: Sequence[int] = ()) -> PrefixSession:
        """Resume from the longest prefix of the prompt that every stage holds: the index's entries, and (for
        what the stages kept before this index existed) the prompt's own keep points and the first stage's
        longest kept prefix of it. A whole prompt counts only with its logits. The hit is pinned until
        `resumed_done` (no other request evicts it meanwhile)."""
        s = cls(index, release_ids, prompt, tuple(sorted(set(boundaries))))
        index.counters.lookups += 1
        if not index.enabled or not prompt:
            return s
        lengths = {e.length: e.prefix_id for e in index.matches(prompt)}
        unknown = [n for n in keep_points(len(prompt), s.boundaries, index.grid, 0) if n not in lengths]
        lengths.update({n: pid for n, pid in ids_along(prompt, unknown).items()})
        found = await find(prompt) if find is not None else None
        if found is not None and found[1] and found[0] == prefix_id(prompt[:found[1]]):
            lengths[found[1]] = found[0]
        whole = lengths.get(len(prompt))
        answer = await held(list(lengths.values()), whole)
        for n in sorted(lengths, reverse=True):
            pid = lengths[n]
            if answer.lengths.get(pid) != n:
                if pid in index.entries:
                    index.lost(pid)
                continue
            if n == len(prompt) and answer.logits is None:  # kept, but not the logits its first token needs
                continue
            if pid not in index.entries:
                evicted = index.adopt(pid, prompt[:n])
                if evicted is None:
                    continue
                if evicted:
                    await release_ids(evicted)
            s.resumed, s.logits = index.entries[pid], answer.logits if n == len(prompt) else None
            index.hit(s.resumed, whole=n == len(prompt))
            index.pin(pid)
            break
        return s

    @property
    def cached_tokens(self) -> int:
        return 0 if self.resumed is None else self.resumed.length

    @property
    def created_tokens(self) -> int:
        """Prompt tokens this request's kept states hold beyond what it resumed (Anthropic's cache creation)."""
        return max(0, self.kept_upto - self.cached_tokens)

    def resumed_done(self) -> None:
        """The forward that resumed from the entry is over (the stages copied what they need): unpin it."""
        if self.resumed is not None and not self._unpinned:
            self._unpinned = True
            self.index.unpin(self.resumed.prefix_id)

    def missing(self) -> None:
        """The resume failed on some stage: the request starts from token 0."""
        self.resumed_done()
        if self.resumed is not None:
            self.index.lost(self.resumed.prefix_id)
            self.index.counters.hits -= 1
            self.index.counters.whole -= int(self.logits is not None)
            self.index.counters.tokens_saved -= self.resumed.length
            self.resumed, self.logits = None, None

    async def save_points(self, start: int, end: int) -> tuple[tuple[int, str], ...]:
        """The (tokens, id) to keep after the prompt chunk [start, end): its keep points, at most as many
        inside it as the stages' memory takes at once."""
        points = [p for p in keep_points(len(self.prompt), self.boundaries, self.index.grid, start) if p <= end]
        inside = inside_forward(points, self.boundaries, end, self.index.fits_inside(end))
        out = []
        for p in [*inside, *([end] if end in points else [])]:
            pid = await self._reserve(self.prompt[:p])
            if pid is not None:
                out.append((p, pid))
                self.kept_upto = max(self.kept_upto, p)
        return tuple(out)

    async def finish(self, fed: list[int]) -> str | None:
        """The id to keep the finished session under (`fed`: every token its state has seen)."""
        return await self._reserve(fed)

    async def _reserve(self, tokens: list[int]) -> str | None:
        pid, evicted = self.index.reserve(tokens)
        if evicted:
            await self.release_ids(evicted)
        if pid is not None:
            self.kept.append(pid)
        return pid

    def failed(self, pids: Sequence[str]) -> None:
        """Keeping these did not happen (their forward failed)."""
        for pid in pids:
            self.index.drop(pid)
