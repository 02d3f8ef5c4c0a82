"""Per-sequence state a stage keeps for its layers: KDA conv window + recurrent state, MLA latents.

Updates replace tensors rather than writing into them (KDA) or only append past `length` (MLA), so a
snapshot is a handful of references and restoring one undoes a failed forward exactly. The same holds for
a prefix kept after its request (`share`): it references the state as it was, whatever the session does
next; a session resumed from it (`resume`) copies only the MLA latents, the part it will write into.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deltafin.checkpoint.config import LayerKind, ModelConfig
from deltafin.models.pieces import mla_capacity


@dataclass(frozen=True)
class KDATrail:
    """What a speculative forward fed one KDA layer, enough to recompute its state after any of its tokens
    (a few vectors per token, where a state per token would be 4 MB per layer at K3's width)."""

    conv: torch.Tensor  # [3, K-1+T, P]: the window before the forward, then the T tokens' conv inputs
    state: torch.Tensor  # [H, dk, dv] before the forward
    k: torch.Tensor  # [T, H, dk]
    v: torch.Tensor  # [T, H, dv]
    g: torch.Tensor  # [T, H, dk]
    beta: torch.Tensor  # [T, H]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.k, self.v, self.g, self.beta))


@dataclass
class KDACache:
    conv: torch.Tensor  # [3, K-1, P] fp32: the last K-1 pre-convolution q, k, v inputs
    state: torch.Tensor  # [H, dk, dv] fp32
    # a speculative forward sets `speculative`; the layer runs the exact recurrence and leaves its `trail`
    speculative: bool = field(default=False, repr=False)
    trail: KDATrail | None = field(default=None, repr=False)
    # states to take inside the next forward (a kept prefix ending there): offsets into the forward, the tokens
    # fed so far (a long forward runs in pieces) and, by offset, the (conv, state) taken
    marks: tuple[int, ...] = field(default=(), repr=False)
    fed: int = field(default=0, repr=False)
    taken: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * 4 + self.state.numel() * 4


@dataclass
class MLACache:
    """Latents (c [r] and k_r [rope]: 576 values per token for K3) of every token seen so far."""

    buf: torch.Tensor  # [capacity, r + rope]
    length: int = 0

    def append(self, latents: torch.Tensor) -> torch.Tensor:
        """Append [T, r+rope]; returns all latents [length, r+rope] (a view of the buffer). The buffer grows in
        whole blocks (sizing.mla_capacity), so its size is what the memory plan counts."""
        need = self.length + latents.shape[0]
        if need > self.buf.shape[0]:
            grown = self.buf.new_empty(mla_capacity(need), self.buf.shape[1])
            grown[: self.length] = self.buf[: self.length]
            self.buf = grown
        self.buf[self.length:need] = latents.to(self.buf.dtype)
        self.length = need
        return self.buf[:need]

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


LayerCache = KDACache | MLACache


@dataclass
class SequenceCache:
    """One session's state for the layers of one stage."""

    layers: dict[int, LayerCache]
    length: int = 0  # tokens this stage has processed for the session
    logits: torch.Tensor | None = None  # a kept prompt's, on the last stage: what its first output token needs
    _snapshot: tuple | None = field(default=None, repr=False)
    # after a speculative forward of tokens [start, length): start and its KDA layers' trails (their state
    # is the one before it), until the next forward says where to continue (the drafts after it rejected)
    marks: tuple[int, dict[int, KDATrail]] | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Its caches (what the session budget holds; not the trails of a speculative forward), and a kept
        prompt's logits."""
        return sum(c.nbytes for c in self.layers.values()) + (0 if self.logits is None else self.logits.numel() * 4)

    @property
    def trail_bytes(self) -> int:
        """While a speculative forward's position is undecided: what its KDA layers keep to rewind with."""
        return 0 if self.marks is None else sum(t.nbytes for t in self.marks[1].values())

    def growth(self, new_tokens: int) -> int:
        """Bytes the caches grow by when `new_tokens` more tokens arrive."""
        out = 0
        for c in self.layers.values():
            if isinstance(c, MLACache) and c.length + new_tokens > c.buf.shape[0]:
                out += (mla_capacity(c.length + new_tokens) - c.buf.shape[0]) * c.buf.shape[1] * c.buf.element_size()
        return out

    def share(self) -> SequenceCache:
        """The state as it is now, by reference (KDA tensors are replaced on update, MLA buffers only appended
        to past `length`): what a prefix snapshot keeps. Its `nbytes` is what it keeps alive: a buffer grows
        to mla_capacity(length) at most before it is reallocated, so sharing one costs no more than a copy."""
        layers: dict[int, LayerCache] = {
            i: KDACache(c.conv, c.state) if isinstance(c, KDACache) else MLACache(c.buf, c.length)
            for i, c in self.layers.items()}
        return SequenceCache(layers, self.length)

    def resume_bytes(self, room: int) -> int:
        """What `resume(room)` holds: the KDA states, and MLA buffers with room for `room` more tokens (not the
        kept logits, which stay with the prefix)."""
        return sum(c.nbytes if isinstance(c, KDACache) else
                   mla_capacity(c.length + room) * c.buf.shape[1] * c.buf.element_size() for c in self.layers.values())

    def resume(self, room: int) -> SequenceCache:
        """A live session that continues from this state: KDA tensors shared, MLA latents copied into buffers
        of their own with room for `room` more tokens (appending into a shared buffer would overwrite what
        another holder of it sees)."""
        layers: dict[int, LayerCache] = {}
        for i, c in self.layers.items():
            if isinstance(c, KDACache):
                layers[i] = KDACache(c.conv, c.state)
            else:
                buf = c.buf.new_empty(mla_capacity(c.length + room), c.buf.shape[1])
                buf[:c.length] = c.buf[:c.length]
                layers[i] = MLACache(buf, c.length)
        return SequenceCache(layers, self.length)

    def mark(self, offsets: list[int]) -> None:
        """Before a forward: take the state after each of these many of its tokens (0 < offset < its length)
        as it runs, for `taken_at` (KDA states are taken by the layers; MLA latents are rows already kept)."""
        for c in self.layers.values():
            if isinstance(c, KDACache):
                c.marks, c.fed, c.taken = tuple(offsets), 0, {}

    def taken_at(self, length: int, offset: int) -> SequenceCache:
        """After a marked forward that started at `length` tokens: the state after `offset` of its tokens, as a
        prefix of its own (KDA states as taken, MLA latents copied into buffers of their size)."""
        layers: dict[int, LayerCache] = {}
        for i, c in self.layers.items():
            if isinstance(c, KDACache):
                layers[i] = KDACache(*c.taken[offset])
            else:
                rows = length + offset
                buf = c.buf.new_empty(mla_capacity(rows), c.buf.shape[1])
                buf[:rows] = c.buf[:rows]
                layers[i] = MLACache(buf, rows)
        return SequenceCache(layers, length + offset)

    def clear_marks(self) -> None:
        for c in self.layers.values():
            if isinstance(c, KDACache):
                c.marks, c.fed, c.taken = (), 0, {}

    def start_trail(self) -> None:
        """Before a speculative forward: its KDA layers keep what they were fed (`KDATrail`)."""
        for c in self.layers.values():
            if isinstance(c, KDACache):
                c.speculative, c.trail = True, None

    def end_trail(self, tokens: int) -> None:
        """After a forward (`length` already counts its tokens). A speculative one of `tokens` tokens leaves
        its KDA layers at the state before it, with the trail to recompute any of its positions: the next
        forward (or release) says which (`rewind`), and no second state per layer is ever held. Any other
        forward continued from what came before: nothing to keep."""
        self.marks = None
        if tokens:
            trails = {}
            for i, c in self.layers.items():
                if isinstance(c, KDACache):
                    t = trails[i] = c.trail
                    c.state, c.conv = t.state, t.conv[:, :t.conv.shape[1] - t.k.shape[0]]  # type: ignore[union-attr]
            self.marks = (self.length - tokens, trails)  # type: ignore[assignment]
        self.drop_trail()

    def drop_trail(self) -> None:
        for c in self.layers.values():
            if isinstance(c, KDACache):
                c.speculative, c.trail = False, None

    @property
    def pending(self) -> bool:
        """A speculative forward's position has yet to be chosen (`rewind`) before the state can be used."""
        return self.marks is not None

    def rewind(self, length: int, recurrence: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Continue from `length` tokens, one of the positions the last speculative forward fed (after its
        first token, up to its end); False if it is none. KDA states are recomputed from the trails with
        `recurrence`, the function the forward ran, so they are the states it had there."""
        if self.marks is None:
            return False
        start, trails = self.marks
        if not start < length <= self.length:
            return False
        n = length - start
        for i, c in self.layers.items():
            if isinstance(c, KDACache):
                t = trails[i]
                # the outputs are not needed: any query will do (k); the state sequence is the forward's
                _, c.state = recurrence(t.k[:n], t.k[:n], t.v[:n], t.g[:n], t.beta[:n], t.state)
                c.conv = t.conv[:, n:n + t.conv.shape[1] - t.k.shape[0]]
            else:
                c.length = length
        self.length = length
        self.marks = None
        return True

    def snapshot(self) -> None:
        self._snapshot = (self.length, {i: (c.conv, c.state) if isinstance(c, KDACache) else (c.buf, c.length)
                                        for i, c in self.layers.items()})

    def forget_snapshot(self) -> None:
        """Drop the references `snapshot()` holds (a state that is kept must not hold older tensors alive)."""
        self._snapshot = None

    def restore(self) -> None:
        """Undo everything since `snapshot()` (a forward that failed half-way)."""
        self.clear_marks()
        if self._snapshot is None:
            return
        self.length, saved = self._snapshot
        for i, (a, b) in saved.items():
            c = self.layers[i]
            if isinstance(c, KDACache):
                c.conv, c.state = a, b
            else:
                c.buf, c.length = a, b


def new_sequence_cache(cfg: ModelConfig, layers: range, device: torch.device, dtype: torch.dtype,
                       tokens: int = 1) -> SequenceCache:
    """Empty caches for `layers`, with MLA room for `tokens` tokens (whole blocks)."""
    caches: dict[int, LayerCache] = {}
    for i in layers:
        if cfg.layer_kinds[i] is LayerKind.KDA:
            caches[i] = KDACache(
                conv=torch.zeros(3, cfg.conv_kernel - 1, cfg.kda_dim, device=device),
                state=torch.zeros(cfg.kda_heads, cfg.kda_head_dim, cfg.kda_head_dim, device=device))
        else:
            width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
            caches[i] = MLACache(torch.zeros(mla_capacity(tokens), width, device=device, dtype=dtype))
    return SequenceCache(caches)
