"""The coordinator's half of the prefix cache: which token prefixes the stages hold state for.

Every stage keeps its layers' part of a prefix under one id (deltafin/runtime/prefix_store.py); this index maps token
sequences to those ids and decides what is kept. A request resumes from the longest indexed prefix of its
prompt that leaves at least one prompt token to feed (the first output token needs that token's logits);
its KDA states are exactly the prefix's, its MLA latents the prefix's rows, so nothing is recomputed.
While it runs, the request keeps its state at block boundaries inside a long prompt (every `block`
tokens), at the end of its prompt, and when it finishes (every token fed: the prompt and all but the last
generated token). The next turn of a chat resumes from the finished state when the client sends the
assistant's tokens back unchanged, and from the prompt's end (or a block inside it) when it does not.

The index does the stages' byte accounting itself, from each stage's planned prefix budget and the exact
size of a kept state (sizing.sequence_bytes), and evicts least-recently-used entries before any stage
would have to: so an indexed prefix is there when it is asked for. If one is missing anyway (a worker was
replaced), the request starts from the beginning and the entry is dropped.
"""

from __future__ import annotations

import uuid
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from deltafin.checkpoint.config import LayerKind, ModelConfig
from deltafin.plan.sizing import sequence_bytes
from deltafin.runtime.prefix_store import PrefixBudget

PREFIX_BLOCK = 4096  # prompt tokens between the states kept inside a long prompt


@dataclass(frozen=True)
class StageShare:
    """One stage's part of every prefix: its KDA and MLA layers, the bytes it may keep, its latents' size."""

    n_kda: int
    n_mla: int
    budget: int
    act_bytes: int


def stage_shares(cfg: ModelConfig, stages: Sequence[PrefixBudget]) -> list[StageShare]:
    out = []
    for s in stages:
        kinds = cfg.layer_kinds[s.start:s.end]
        out.append(StageShare(sum(k is LayerKind.KDA for k in kinds), sum(k is LayerKind.MLA for k in kinds),
                              s.budget, s.act_bytes))
    return out


@dataclass
class Entry:
    prefix_id: str
    tokens: array  # the token ids the kept state has seen

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class PrefixCounters:
    lookups: int = 0
    hits: int = 0
    tokens_saved: int = 0  # prompt tokens not prefilled again
    kept: int = 0
    evicted: int = 0
    missing: int = 0  # indexed, but a stage no longer had it


class PrefixIndex:
    def __init__(self, cfg: ModelConfig, shares: list[StageShare] | None = None, block: int = PREFIX_BLOCK):
        self.cfg, self.block = cfg, block
        self.shares = shares or []
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.pinned: dict[str, int] = {}  # entries a request is about to resume from: never evicted meanwhile
        self.counters = PrefixCounters()

    @property
    def enabled(self) -> bool:
        return bool(self.shares) and all(s.budget > 0 for s in self.shares)

    def reshape(self, shares: list[StageShare]) -> list[str]:
        """The stages changed (a re-plan): their new budgets; entries beyond them are evicted (returned)."""
        self.shares = shares
        return self._evict_for(0) or []

    def cost(self, share: StageShare, length: int) -> int:
        return sequence_bytes(self.cfg, share.n_kda, share.n_mla, length, share.act_bytes)

    def used(self, share: StageShare) -> int:
        return sum(self.cost(share, e.length) for e in self.entries.values())

    def lookup(self, prompt: Sequence[int]) -> Entry | None:
        """The longest entry whose tokens begin `prompt` and leave at least one prompt token to feed."""
        self.counters.lookups += 1
        if not self.enabled or len(prompt) < 2:
            return None
        want = array("i", prompt)
        best = None
        for e in self.entries.values():
            if e.length < len(want) and (best is None or e.length > best.length) and e.tokens == want[:e.length]:
                best = e
        if best is not None:
            self.entries.move_to_end(best.prefix_id)
            self.counters.hits += 1
            self.counters.tokens_saved += best.length
        return best

    def reserve(self, tokens: Sequence[int]) -> tuple[str | None, list[str]]:
        """An id to keep the state of `tokens` under, and the ids evicted to make room for it (release them
        on the stages first). None when it could never fit, or an entry already holds exactly these tokens."""
        if not self.enabled or not tokens:
            return None, []
        want = array("i", tokens)
        if any(e.length == len(want) and e.tokens == want for e in self.entries.values()):
            return None, []
        if any(self.cost(s, len(want)) > s.budget for s in self.shares):
            return None, []
        evicted = self._evict_for(len(want))
        if evicted is None:
            return None, []
        prefix_id = "prefix-" + uuid.uuid4().hex
        self.entries[prefix_id] = Entry(prefix_id, want)
        self.counters.kept += 1
        return prefix_id, evicted

    def adopt(self, prefix_id: str, tokens: Sequence[int]) -> list[str] | None:
        """Index a prefix the stages kept before this index existed (found on the first stage's disk after a
        restart) under its own id; the ids evicted for its room, or None if it cannot fit."""
        want = array("i", tokens)
        if not self.enabled or prefix_id in self.entries or any(self.cost(s, len(want)) > s.budget
                                                                 for s in self.shares):
            return None
        evicted = self._evict_for(len(want))
        if evicted is not None:
            self.entries[prefix_id] = Entry(prefix_id, want)
        return evicted

    def _evict_for(self, length: int) -> list[str] | None:
        """Evict least-recently-used entries until one of `length` tokens fits every stage (0: until the
        entries fit); None if it cannot, for the pinned entries (nothing is evicted then)."""
        over = lambda: any(self.used(s) + (self.cost(s, length) if length else 0) > s.budget for s in self.shares)
        victims, kept = [], dict(self.entries)
        for prefix_id in list(self.entries):
            if not over():
                break
            if prefix_id not in self.pinned:
                victims.append(prefix_id)
                del self.entries[prefix_id]
        if over() and length:
            self.entries = OrderedDict(kept)  # not without a pinned entry: undo
            return None
        self.counters.evicted += len(victims)
        return victims

    def pin(self, prefix_id: str) -> None:
        self.pinned[prefix_id] = self.pinned.get(prefix_id, 0) + 1

    def unpin(self, prefix_id: str) -> None:
        n = self.pinned.pop(prefix_id, 0) - 1
        if n > 0:
            self.pinned[prefix_id] = n

    def drop(self, prefix_id: str) -> None:
        self.entries.pop(prefix_id, None)

    def lost(self, prefix_id: str) -> None:
        """A stage did not have it: forget it."""
        self.counters.missing += 1
        self.drop(prefix_id)


ReleaseIds = Callable[[list[str]], Awaitable[None]]


@dataclass
class PrefixSession:
    """One request's use of the index: where it resumes, what it keeps as it goes, what it leaves behind.
    `release_ids` frees evicted prefixes on the stages before the state that needs their room is kept."""

    index: PrefixIndex
    release_ids: ReleaseIds
    prompt: list[int]
    resumed: Entry | None = None
    kept: list[str] = field(default_factory=list)
    _unpinned: bool = False

    @classmethod
    def start(cls, index: PrefixIndex, release_ids: ReleaseIds, prompt: list[int]) -> PrefixSession:
        """Look the prompt up; a hit is pinned until `resumed_done` (no other request evicts it meanwhile)."""
        hit = index.lookup(prompt)
        if hit is not None:
            index.pin(hit.prefix_id)
        return cls(index, release_ids, prompt, hit)

    @property
    def cached_tokens(self) -> int:
        return 0 if self.resumed is None else self.resumed.length

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
            self.index.counters.tokens_saved -= self.resumed.length
            self.resumed = None

    async def save_point(self, start: int, end: int) -> str | None:
        """The id to keep the state under after the prompt chunk [start, end), if it ends the prompt or
        crosses a block boundary."""
        if end != len(self.prompt) and end // self.index.block == start // self.index.block:
            return None
        return await self._reserve(self.prompt[:end])

    async def finish(self, fed: list[int]) -> str | None:
        """The id to keep the finished session under (`fed`: every token its state has seen)."""
        return await self._reserve(fed)

    async def _reserve(self, tokens: list[int]) -> str | None:
        prefix_id, evicted = self.index.reserve(tokens)
        if evicted:
            await self.release_ids(evicted)
        if prefix_id is not None:
            self.kept.append(prefix_id)
        return prefix_id

    def failed(self, prefix_id: str) -> None:
        """Keeping `prefix_id` did not happen (its forward failed)."""
        self.index.drop(prefix_id)
