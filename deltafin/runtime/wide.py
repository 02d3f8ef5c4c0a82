"""Wide experts (docs/DESIGN.md): a layer's routed experts computed by every holder of their bytes at once.

The stage side, `WideExperts`, is the model's RoutedExperts (models/moe.py): once a layer's router has chosen, it
sends each holder only the latent rows of the tokens routed to that holder's experts, with the (row, expert) pairs
and their routing weights, computes its own share meanwhile, and adds the holders' answers: each holder sends back
one row per token, its pairs' weighted outputs summed (models.moe.weighted_row_sums), not one row per pair, so the
bytes back are the bytes out. A prompt's call divides the experts it touches so that every holder finishes
together, its rows' and sums' crossings counted (plan/cluster/prompt_split.py, `prompt_owners`); every other call
follows the placement. Each expert sees the same rows in the same order wherever it runs, so every pair's output is the
one-process path's, bit for bit; the sum of a token's 16 weighted outputs is grouped by holder (each holder's
share, then the holders in placement order), so a wide stage's result equals one process's to fp32 rounding (the
order of that sum), not bit for bit. The holder side, `ExpertHolder`, computes a call's pairs
from the worker's expert store. How a call reaches a holder (`Peer`) is given: gRPC between workers
(worker/peers.py), or direct calls on a thread of their own in one process (`LocalPeer`: tests).

Shapes: N tokens, k slots, P = N*k pairs (row-major: pair p is token p // k, slot p % k), Ph a holder's pairs,
Th its distinct rows (tokens), De the expert width.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.checkpoint.shards import id_ranges
from deltafin.errors import InvalidInput, NotHeld
from deltafin.models.moe import Landed, weighted_row_sums
from deltafin.plan.cluster.expert_placement import ExpertRanges
from deltafin.plan.cluster.prompt_split import PromptSplit
from deltafin.runtime.read_ahead import prompt_like
from deltafin.runtime.worker_stats import HolderStats, WideStats

log = logging.getLogger(__name__)
SUMS_PART_BYTES = 256 << 10  # a holder's sums go back in parts of about this much, each as its rows are done


@dataclass(frozen=True)
class ExpertCall:
    """One holder's part of a layer: expert `experts[p]` on `z[rows[p]]` for every pair p; `hints` are the
    stage's guesses of later layers' experts (layer, ids most likely first) for the holder's disk to read ahead."""

    layer: int
    z: torch.Tensor  # [Th, De] the rows routed to this holder's experts, in token order
    rows: torch.Tensor  # [Ph] int64, into z, not decreasing (a token's pairs together, in slot order)
    experts: torch.Tensor  # [Ph] int64 expert ids
    weights: torch.Tensor  # [Ph] fp32 the pairs' routing weights: the holder answers each row's weighted sum
    hints: tuple[tuple[int, tuple[int, ...]], ...] = ()
    bf16: bool = False  # the lossy wire (--wire bf16): z comes, and the sums go back, as bfloat16

    @property
    def pairs(self) -> int:
        return int(self.rows.shape[0])


class Peer(Protocol):
    """A holder as a stage reaches it."""

    name: str

    def call(self, call: ExpertCall) -> Callable[[], torch.Tensor]:
        """Send the call; the returned function waits for its rows' weighted sums [Th, De] fp32 (HolderError on
        failure)."""
        ...

    def hint(self, hints: tuple[tuple[int, tuple[int, ...]], ...], ahead: bool = False) -> None:
        """Pass guesses on without waiting (a holder that does not get them only reads later); `ahead`: a prompt's,
        read as far ahead as the holder's slots allow."""
        ...


class Provider(Protocol):
    """What a worker's expert store offers the wide path (weights/store.py's ExpertStore)."""

    layers: set[int]

    def pair_outputs(self, layer: int, z: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                     landed: Landed | None = None) -> torch.Tensor: ...

    def prefetch(self, layer: int, ids: Sequence[int], ahead: bool = False) -> None: ...


@dataclass
class HolderCounts:
    """One holder's calls as the stage saw them."""

    calls: int = 0
    experts: int = 0  # distinct experts asked for, summed over calls
    pairs: int = 0
    seconds: float = 0.0  # from sending a call to having its outputs


@dataclass
class WideCounts:
    """The stage side: its calls per holder, and how long it waited for peers after its own share was done."""

    holders: dict[str, HolderCounts] = field(default_factory=dict)
    peer_wait_s: float = 0.0

    def holder(self, name: str) -> HolderCounts:
        return self.holders.setdefault(name, HolderCounts())


class WideExperts:
    """The stage side (see the module docstring). `me`: this worker's key in the placement (None: it holds no
    share); `local`: its expert store; `peers`: every other holder by key."""

    def __init__(self, cfg: ModelConfig, ranges: ExpertRanges, me: str | None, local: Provider | None,
                 peers: Mapping[str, Peer], names: Mapping[str, str] | None = None, lossy: bool = False,
                 prompts: PromptSplit | None = None):
        """`lossy`: the other holders' rows go, and their sums come back, as bfloat16 (--wire bf16). `prompts`: how
        a call whose pairs outnumber the layer's experts (a prompt's) divides them (plan/cluster/prompt_split.py; None:
        by the placement, as every other call)."""
        self.cfg, self.ranges, self.local, self.peers, self.lossy = cfg, ranges, local, dict(peers), lossy
        self.prompts = prompts
        self.me = ranges.index(me) if me is not None else None
        if self.me is not None and local is None:
            raise ValueError("a holder of experts needs its store")
        missing = [h for i, h in enumerate(ranges.holders) if i != self.me and h not in self.peers]
        if missing:
            raise ValueError(f"no peer for holders {missing}")
        self.names = {h: (names or {}).get(h, h) for h in ranges.holders}
        self._owners = {layer: self._owner_table(layer) for layer in ranges.layers}
        self.stats = WideCounts()
        self._forward: dict[int, list[float]] = {}  # holder -> [experts, seconds] since begin_forward

    def _owner_table(self, layer: int) -> torch.Tensor:
        owner = torch.empty(self.cfg.num_experts, dtype=torch.long)
        b = self.ranges.bounds_of(layer)
        for i in range(len(self.ranges.holders)):
            owner[b[i]:b[i + 1]] = i
        return owner

    # ---- RoutedExperts ----------------------------------------------------------------------------------------

    def __call__(self, layer: int, z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor
                 ) -> Callable[[], torch.Tensor]:
        n_tok, k = idx.shape
        ids, w = idx.reshape(-1).cpu(), weights.reshape(-1).float().cpu()
        rows = torch.arange(n_tok).repeat_interleave(k)
        home = ids % self.cfg.num_experts  # an expert mode's copy (E + e) is read where expert e is
        if self.prompts is not None and n_tok * k > self.cfg.num_experts:
            owner = prompt_owners(self.prompts, self.ranges.bounds_of(layer), home, n_tok)
        else:
            owner = self._owners[layer][home]
        parts: list[tuple[int, ExpertCall, torch.Tensor]] = []  # (holder, its call, the tokens of its rows)
        for h in torch.unique(owner).tolist():
            sel = (owner == h).nonzero(as_tuple=True)[0]  # its pairs, in row-major order
            tokens, local_rows = torch.unique(rows[sel], sorted=True, return_inverse=True)
            zh, wire = z[tokens.to(z.device)], self.lossy and h != self.me
            parts.append((h, ExpertCall(layer, zh.to(torch.bfloat16) if wire else zh, local_rows, ids[sel], w[sel],
                                        bf16=wire), tokens))
        started = time.monotonic()
        waits = {h: self.peers[self.ranges.holders[h]].call(call) for h, call, _ in parts if h != self.me}

        def finish() -> torch.Tensor:
            sums = {}
            for h, call, _ in parts:
                if h == self.me:
                    t0 = time.monotonic()
                    sums[h] = ExpertHolder.summed(self.local, call, z.device)  # type: ignore[arg-type]
                    self._count(h, call.experts, time.monotonic() - t0)
            t0 = time.monotonic()
            for h, call, _ in parts:
                if h in waits:
                    sums[h] = waits[h]().to(z.device)
                    self._count(h, call.experts, time.monotonic() - started)
            self.stats.peer_wait_s += time.monotonic() - t0
            y = torch.zeros(n_tok, self.cfg.expert_dim, dtype=torch.float32, device=z.device)
            for h, _, tokens in parts:  # the holders' sums, in placement order
                y[tokens.to(z.device)] += sums[h].to(y.dtype)
            return y

        return finish

    def _count(self, holder: int, ids: torch.Tensor, seconds: float) -> None:
        c = self.stats.holder(self.names[self.ranges.holders[holder]])
        experts = int(torch.unique(ids).numel())
        c.calls, c.experts, c.pairs, c.seconds = c.calls + 1, c.experts + experts, c.pairs + ids.numel(), \
            c.seconds + seconds
        step = self._forward.setdefault(holder, [0, 0.0])
        step[0] += experts
        step[1] += seconds

    # ---- prefetch ------------------------------------------------------------------------------------------------

    def prefetch(self, guesses: Sequence[tuple[int, Sequence[int]]], tokens: int = 1) -> None:
        """The stage's guesses as a layer starts ((layer, ids most likely first): its own and the next one's, for a
        forward of `tokens` tokens): this worker's share to its own store, and to every other holder one message
        with its share of all of them (a prompt's divided as its calls will be), without waiting, so that its disk
        reads ahead while this layer computes."""
        remote: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        ahead = prompt_like(self.cfg.experts_per_token, self.cfg.num_experts, tokens)
        for layer, ids in guesses:
            if layer not in self._owners or not ids:
                continue
            guessed = torch.tensor(list(ids), dtype=torch.long) % self.cfg.num_experts  # (a copy's id: E + e)
            owner = prompt_owners(self.prompts, self.ranges.bounds_of(layer), guessed, tokens).tolist() \
                if self.prompts is not None and ahead else self._owners[layer][guessed].tolist()
            by_holder: dict[int, list[int]] = {}
            for e, h in zip(ids, owner, strict=True):
                by_holder.setdefault(int(h), []).append(int(e))
            for h, guess in by_holder.items():
                if h == self.me:
                    self.local.prefetch(layer, guess, ahead=ahead)  # type: ignore[union-attr]
                else:
                    remote.setdefault(h, []).append((layer, tuple(guess)))
        for h, hints in remote.items():
            self.peers[self.ranges.holders[h]].hint(tuple(hints), ahead)

    # ---- per forward (the -v log) ------------------------------------------------------------------------------

    def begin_forward(self) -> None:
        self._forward.clear()

    def describe_forward(self) -> str:
        """Each holder's experts and seconds in the forward since `begin_forward` (self: its own share)."""
        parts = []
        for h in sorted(self._forward):
            experts, seconds = self._forward[h]
            who = self.names[self.ranges.holders[h]] + (" (self)" if h == self.me else "")
            parts.append(f"{who} {int(experts)} experts {seconds * 1000:.1f} ms")
        return ", ".join(parts)


def prompt_owners(split: PromptSplit, bounds: Sequence[int], ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """The holder of each of `ids` (a prompt's pairs' experts, or guesses of them) for a forward of `tokens` tokens,
    divided as `split` counts (plan/cluster/prompt_split.py): each holder keeps the experts of its own range (`bounds`:
    the placement's) it has room for, lowest first, and the rest go to the holders with room left, in placement
    order."""
    n = len(bounds) - 1
    distinct = torch.unique(ids)
    home = torch.bucketize(distinct, torch.tensor(bounds[1:], dtype=distinct.dtype), right=True)
    want = split.counts(int(distinct.numel()), tokens, [bounds[i + 1] > bounds[i] for i in range(n)])
    new = home.clone()
    taken = [0] * n
    spare: list[int] = []
    for j, h in enumerate(home.tolist()):
        if taken[h] < want[h]:
            taken[h] += 1
        else:
            spare.append(j)
    at = 0
    for h in range(n):
        while taken[h] < want[h] and at < len(spare):
            new[spare[at]] = h
            taken[h] += 1
            at += 1
    return new[torch.searchsorted(distinct, ids)]


@dataclass
class ServedCounts:
    calls: int = 0
    pairs: int = 0
    seconds: float = 0.0


class ExpertHolder:
    """The holder side: other stages' calls computed from this worker's expert store (on a thread of their own,
    beside the worker's stage), with counters."""

    def __init__(self, cfg: ModelConfig, store: Provider, device: torch.device, dtype: torch.dtype = torch.float32):
        """`dtype`: the worker's activations, which a call's rows are computed in whatever they came as."""
        self.cfg, self.store, self.device, self.dtype = cfg, store, device, dtype
        self.served = ServedCounts()
        self._lock = threading.Lock()

    def check(self, call: ExpertCall) -> None:
        """A call this holder can compute, or InvalidInput / NotHeld saying why not."""
        e, t = self.cfg.num_experts, call.z.shape[0] if call.z.dim() == 2 else -1
        if call.z.dim() != 2 or call.z.shape[1] != self.cfg.expert_dim or call.z.dtype not in (torch.float32,
                                                                                               torch.bfloat16):
            raise InvalidInput(f"an expert call's rows must be float32 or bfloat16 [T, {self.cfg.expert_dim}]; got "
                               f"{call.z.dtype} {list(call.z.shape)}")
        if call.rows.shape != call.experts.shape or call.rows.shape != call.weights.shape or call.rows.dim() != 1 \
                or call.pairs == 0:
            raise InvalidInput("an expert call needs as many rows as experts and weights, and at least one pair")
        if call.weights.dtype != torch.float32 or not bool(torch.isfinite(call.weights).all()):
            raise InvalidInput("an expert call's weights must be finite float32")
        if call.pairs > 1 and bool((call.rows[1:] < call.rows[:-1]).any()):
            raise InvalidInput("an expert call's rows must not decrease (a token's pairs together, in order)")
        if int(call.rows.min()) < 0 or int(call.rows.max()) >= t:
            raise InvalidInput(f"an expert call's rows must be in [0, {t})")
        e = getattr(self.store, "id_count", e)  # a store with an expert mode's copy serves E + e too
        if int(call.experts.min()) < 0 or int(call.experts.max()) >= e:
            raise InvalidInput(f"expert ids must be in [0, {e})")
        if call.layer not in self.store.layers:
            raise NotHeld(f"layer {call.layer}'s experts are not served here (this worker serves layers "
                          f"{id_ranges(sorted(self.store.layers))}): plan again")
        if not bool(torch.isfinite(call.z).all()):
            raise InvalidInput("an expert call's rows contain NaN or Inf")

    @staticmethod
    def summed(store: Provider, call: ExpertCall, device: torch.device, dtype: torch.dtype | None = None
               ) -> torch.Tensor:
        """Each row's weighted sum of its pairs' outputs [Th, De] fp32, computed from `store` (rows in `dtype`)."""
        out = store.pair_outputs(call.layer, call.z.to(device, dtype or call.z.dtype), call.rows, call.experts)
        return weighted_row_sums(out, call.rows.to(out.device), call.weights.to(out.device), int(call.z.shape[0]))

    @torch.inference_mode()
    def run(self, call: ExpertCall) -> torch.Tensor:
        """The call's rows' weighted sums [Th, De] fp32; its hints go to the store first, behind the call's own
        reads."""
        self.check(call)
        t0 = time.monotonic()
        self.hint(call.hints)
        out = self.summed(self.store, call, self.device, self.dtype)
        self._served(call, t0)
        return out.to(torch.bfloat16) if call.bf16 else out

    @torch.inference_mode()
    def stream(self, call: ExpertCall, send: Callable[[torch.Tensor, torch.Tensor], None],
               part_bytes: int | None = None) -> None:
        """`run`, each row's sum sent as soon as its last pair is done: `send(rows, sums)` (rows sorted, each row of
        the call once in all, the sums the bits `run` gives), in parts of about `part_bytes`, so the first rows cross
        the link while the holder computes the rest of its experts."""
        self.check(call)
        t0 = time.monotonic()
        self.hint(call.hints)
        n_rows, rows = int(call.z.shape[0]), call.rows
        left = torch.bincount(rows, minlength=n_rows)  # pairs not done, per row
        done: list[torch.Tensor] = []
        per_part = max(1, (part_bytes or SUMS_PART_BYTES) // (self.cfg.expert_dim * (2 if call.bf16 else 4)))

        def flush(out: torch.Tensor) -> None:
            which = torch.cat(done).sort().values
            done.clear()
            sums = weighted_row_sums(out, rows.to(out.device), call.weights.to(out.device), n_rows,
                                     only=which.to(out.device))
            send(which, sums.to(torch.bfloat16) if call.bf16 else sums)

        def landed(out: torch.Tensor, sel: torch.Tensor) -> None:
            touched = rows[sel]
            left.index_add_(0, touched, torch.full_like(touched, -1))
            touched = touched.unique()
            done.append(touched[left[touched] == 0])
            if sum(int(d.numel()) for d in done) >= per_part:
                flush(out)

        out = self.store.pair_outputs(call.layer, call.z.to(self.device, self.dtype), rows, call.experts, landed)
        if any(d.numel() for d in done):
            flush(out)
        self._served(call, t0)

    def _served(self, call: ExpertCall, t0: float) -> None:
        with self._lock:
            self.served.calls += 1
            self.served.pairs += call.pairs
            self.served.seconds += time.monotonic() - t0

    def hint(self, hints: tuple[tuple[int, tuple[int, ...]], ...], ahead: bool = False) -> None:
        for layer, ids in hints:
            most = getattr(self.store, "id_count", self.cfg.num_experts)  # (E + e: an expert mode's copy)
            if layer in self.store.layers and all(0 <= e < most for e in ids):
                self.store.prefetch(layer, list(ids), ahead=ahead)


class LocalPeer:
    """A holder in this process, reached on a thread of its own (one per holder, as a machine would be)."""

    def __init__(self, name: str, holder: ExpertHolder, executor: Executor):
        self.name, self.holder, self.executor = name, holder, executor

    def call(self, call: ExpertCall) -> Callable[[], torch.Tensor]:
        future = self.executor.submit(self.holder.run, call)
        return future.result

    def hint(self, hints: tuple[tuple[int, tuple[int, ...]], ...], ahead: bool = False) -> None:
        self.holder.hint(hints, ahead)


def call_pieces(call: ExpertCall, max_bytes: int) -> list[tuple[torch.Tensor, ExpertCall]]:
    """The call cut into pieces of whole experts whose rows and sums stay under `max_bytes` each, with the rows of
    `call.z` each piece's rows are: each expert still sees all its rows, in order, in one piece, and each piece's
    answer (its rows' sums over its pairs) adds into the call's. (One expert's rows and sums, at most 8 * De bytes a
    token, always fit a message that carries a stage's residual state of the same tokens, which is what bounds a
    forward.)"""
    row_bytes = call.z.shape[1] * 4
    if 2 * call.pairs * row_bytes <= max_bytes:
        return [(torch.arange(call.z.shape[0]), call)]
    order = torch.argsort(call.experts, stable=True)  # each expert's pairs together, in their order
    counts = torch.bincount(call.experts[order]).tolist()
    pieces, start, size = [], 0, 0
    bounds = [0]
    for n in (c for c in counts if c):
        if size and 2 * (size + n) * row_bytes > max_bytes:
            bounds.append(start)
            size = 0
        start, size = start + n, size + n
    bounds.append(start)
    for a, b in zip(bounds, bounds[1:], strict=False):
        sel = torch.sort(order[a:b]).values  # back in the call's order: a token's pairs together
        needed, rows = torch.unique(call.rows[sel], sorted=True, return_inverse=True)
        pieces.append((needed, ExpertCall(call.layer, call.z[needed], rows, call.experts[sel], call.weights[sel],
                                          call.hints if not pieces else (), call.bf16)))
    return pieces


def wide_stats(store: Any, holder: ExpertHolder, wide: WideExperts | None, own_layers: range,
               share: str) -> WideStats:
    """A wide worker's counters: its store's reads and hits for its own layers and for other stages', the calls
    it served, its stage's calls to each holder and its wait on them (the StageStats.wide message)."""
    s = store.snapshot_stats()
    own = s.over(own_layers)
    others = s.over([layer for layer in s.by_layer if layer not in own_layers])
    served = holder.served
    stats = WideStats(share, own.expert_bytes, others.expert_bytes, own.lookups, own.hits, others.lookups,
                      others.hits, served.calls, served.pairs, round(served.seconds, 4))
    if wide is None:
        return stats
    return replace(stats, peer_wait_s=round(wide.stats.peer_wait_s, 4),
                   holders=tuple(HolderStats(name, c.calls, c.experts, c.pairs, round(c.seconds, 4))
                                 for name, c in wide.stats.holders.items()))
