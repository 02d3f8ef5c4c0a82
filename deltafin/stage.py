"""A Stage runs layers [start, end) of the model for a batch of sequences (DESIGN.md, the stage contract).

Stage 0 also embeds token ids; the last stage also applies the final mix, norm and head. Between stages
only the residual state travels. Per-session caches live here, with ids, a byte budget, LRU eviction
with a clear error for the evicted session, and explicit release. A forward that fails half-way leaves
every session as it was before the call.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from deltafin.checkpoint import Checkpoint
from deltafin.config import ModelConfig
from deltafin.errors import DeltafinError
from deltafin.models.attn_res import ResidualState
from deltafin.models.cache import SequenceCache, cache_bytes_per_token, cache_fixed_bytes, new_sequence_cache
from deltafin.models.decoder import Span, decoder_layer, embed, head
from deltafin.models.weights import ExpertWeights, LayerWeights, TopWeights
from deltafin.weights.tensors import load_layer, load_top

log = logging.getLogger(__name__)


class StageError(DeltafinError):
    """A request this stage cannot serve (the stage itself stays usable)."""


class InvalidInput(StageError):
    pass


class SessionNotFound(StageError):
    pass


class SessionOutOfSync(StageError):
    pass


class OutOfMemory(StageError):
    pass


@dataclass(frozen=True)
class SeqInput:
    """One sequence of a forward call: `ids` [T] for stage 0, else the residual state of T tokens."""

    session_id: str
    cache_len: int  # tokens already in the session's cache (0 starts a new session)
    ids: torch.Tensor | None = None
    state: ResidualState | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0]) if self.ids is not None else self.state.num_tokens  # type: ignore[union-attr]


@dataclass(frozen=True)
class SeqOutput:
    session_id: str
    state: ResidualState | None = None  # when this is not the last stage
    logits: torch.Tensor | None = None  # fp32 [T or 1, vocab] from the last stage


class ExpertProvider(Protocol):
    def experts(self, layer: int, ids: list[int]) -> Iterable[tuple[int, ExpertWeights]]: ...

    def resident_bytes(self) -> int: ...

    def close(self) -> None: ...


@dataclass
class StageTimings:
    forwards: int = 0
    tokens: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class Stage:
    def __init__(self, ckpt: Checkpoint, start: int, end: int, *, device: torch.device,
                 dtype: torch.dtype = torch.float32, experts: ExpertProvider | None = None,
                 memory_bytes: int | None = None, cache_bytes: int | None = None):
        cfg = ckpt.config
        if not 0 <= start < end <= cfg.num_layers:
            raise DeltafinError(f"invalid layer range [{start}, {end}) for a {cfg.num_layers}-layer model")
        self.cfg, self.ckpt, self.start, self.end = cfg, ckpt, start, end
        self.device, self.dtype = device, dtype
        self.first, self.last = start == 0, end == cfg.num_layers
        ckpt.raise_problems(layers=range(start, end), top=self.first or self.last)
        self._check_memory(memory_bytes, experts)
        t0 = time.monotonic()
        self.layers: dict[int, LayerWeights] = {i: load_layer(ckpt, i, self._place) for i in self.layers_range}
        self.top: TopWeights | None = None
        if self.first or self.last:
            self.top = load_top(ckpt, self._place, first=self.first, last=self.last)
        if experts is None:
            from deltafin.weights.resident import ResidentExperts

            experts = ResidentExperts(ckpt, [i for i in self.layers_range if cfg.is_moe(i)], self.place_matrix)
        self.experts = experts
        log.info("stage [%d, %d) loaded on %s in %.1fs", start, end, device, time.monotonic() - t0)
        self.cache_budget = cache_bytes
        self.sessions: OrderedDict[str, SequenceCache] = OrderedDict()
        self.evicted: OrderedDict[str, str] = OrderedDict()  # session id -> why, for a clear error later
        self.timings = StageTimings()

    @property
    def layers_range(self) -> range:
        return range(self.start, self.end)

    @property
    def blocks_in(self) -> int:
        return self.cfg.blocks_entering(self.start)

    # ---- weights -----------------------------------------------------------------------------------

    def _place(self, t: torch.Tensor, role: str) -> torch.Tensor:
        if role == "vector":
            return t.to(self.device, torch.float32)
        if role == "embedding":
            return t.to(self.device)
        return t.to(self.device, self.dtype)

    def place_matrix(self, t: torch.Tensor) -> torch.Tensor:
        return self._place(t, "matrix")

    def spine_bytes(self) -> int:
        """Resident bytes of this stage's non-expert weights in the compute dtype."""
        size = torch.finfo(self.dtype).bits // 8
        cfg, total = self.cfg, 0
        for i in self.layers_range:
            for s in cfg.layer_tensor_specs(i):
                total += s.numel * (4 if len(s.shape) == 1 or s.dtype == "F32" else size)
        for s in cfg.top_tensor_specs():
            if (self.first and "embed_tokens" in s.name):
                total += s.nbytes
            elif self.last and "embed_tokens" not in s.name:
                total += s.numel * size
        return total

    def _check_memory(self, budget: int | None, experts: ExpertProvider | None) -> None:
        if budget is None:
            return
        spine = self.spine_bytes()
        expert_bytes = (sum(self.cfg.num_experts * self.cfg.bytes_per_expert for i in self.layers_range
                            if self.cfg.is_moe(i)) if experts is None else experts.resident_bytes())
        need = spine + expert_bytes
        if need > budget:
            raise OutOfMemory(
                f"layers [{self.start}, {self.end}) need {need / 1e9:.2f} GB resident (spine {spine / 1e9:.2f} GB, "
                f"experts {expert_bytes / 1e9:.2f} GB) but the memory budget is {budget / 1e9:.2f} GB: "
                "give this stage fewer layers (more workers) or a larger budget")

    # ---- sessions ----------------------------------------------------------------------------------

    def release(self, session_id: str) -> bool:
        """Free a session's caches; False if it did not exist."""
        self.evicted.pop(session_id, None)
        return self.sessions.pop(session_id, None) is not None

    def session_bytes(self) -> int:
        return sum(c.nbytes for c in self.sessions.values())

    def _session(self, item: SeqInput, pinned: set[str]) -> SequenceCache:
        sid = item.session_id
        if item.cache_len == 0:
            self.sessions.pop(sid, None)
            self.evicted.pop(sid, None)
            self._make_room(item.num_tokens, pinned)
            cache = new_sequence_cache(self.cfg, self.layers_range, self.device, self.dtype,
                                       mla_capacity=max(64, item.num_tokens))
            self.sessions[sid] = cache
            return cache
        cache = self.sessions.get(sid)
        if cache is None:
            why = self.evicted.get(sid)
            raise SessionNotFound(f"session {sid!r} is not on this stage"
                                  + (f" ({why})" if why else "") + "; start it again with cache_len 0")
        if cache.length != item.cache_len:
            raise SessionOutOfSync(f"session {sid!r}: this stage holds {cache.length} tokens but the call says "
                                   f"{item.cache_len} (a replayed or concurrent call?)")
        self.sessions.move_to_end(sid)
        self._make_room(item.num_tokens, pinned)
        return cache

    def _make_room(self, new_tokens: int, pinned: set[str]) -> None:
        """Evict least-recently-used sessions (not in this call) until the cache budget fits."""
        if self.cache_budget is None:
            return
        size = torch.finfo(self.dtype).bits // 8
        need = (cache_fixed_bytes(self.cfg, self.layers_range)
                + new_tokens * cache_bytes_per_token(self.cfg, self.layers_range, size))
        for sid in list(self.sessions):
            if self.session_bytes() + need <= self.cache_budget:
                return
            if sid in pinned:
                continue
            self.sessions.pop(sid)
            self.evicted[sid] = f"evicted to make room: the stage cache budget is {self.cache_budget / 1e9:.2f} GB"
            while len(self.evicted) > 4096:
                self.evicted.popitem(last=False)
            log.info("evicted session %s", sid)
        if self.session_bytes() + need > self.cache_budget:
            raise OutOfMemory(f"the session cache budget ({self.cache_budget / 1e9:.3f} GB) cannot hold this "
                              "request's sequences")

    # ---- forward -----------------------------------------------------------------------------------

    def _validate(self, item: SeqInput) -> None:
        if item.cache_len < 0:
            raise InvalidInput(f"session {item.session_id!r}: negative cache_len")
        if self.first:
            ids = item.ids
            if ids is None or ids.dim() != 1 or ids.numel() == 0 or ids.dtype not in (torch.int32, torch.int64):
                raise InvalidInput("stage 0 takes a non-empty 1-D integer tensor of token ids")
            if bool(((ids < 0) | (ids >= self.cfg.vocab_size)).any()):
                raise InvalidInput(f"token ids must be in [0, {self.cfg.vocab_size})")
            return
        st, d, n = item.state, self.cfg.hidden_size, self.blocks_in
        if st is None:
            raise InvalidInput(f"stage [{self.start}, {self.end}) takes a residual state, not token ids")
        t = st.P.shape[0]
        if st.P.shape != (t, d) or st.B.shape != (t, n, d) or t == 0:
            raise InvalidInput(f"residual state must be P [T, {d}] and B [T, {n}, {d}] with T > 0; got "
                               f"P {list(st.P.shape)}, B {list(st.B.shape)}")
        if not (torch.isfinite(st.P).all() and torch.isfinite(st.B).all()):
            raise InvalidInput("residual state contains NaN or Inf")

    @torch.inference_mode()
    def forward(self, batch: list[SeqInput], all_logits: bool = False) -> list[SeqOutput]:
        """Run the stage on a batch of sequences. The last stage returns logits for the last token of
        each sequence (or every token with `all_logits`); the others return the residual state."""
        if not batch or len({b.session_id for b in batch}) != len(batch):
            raise InvalidInput("a forward call needs at least one sequence and distinct session ids")
        for item in batch:
            self._validate(item)
        t0 = time.monotonic()
        pinned = {b.session_id for b in batch}
        caches = [self._session(item, pinned) for item in batch]
        for c in caches:
            c.snapshot()
        try:
            state, spans = self._input(batch, caches)
            for layer in self.layers_range:
                state = decoder_layer(self.cfg, layer, self.layers[layer], state, spans, self.experts.experts)
            outputs = self._output(batch, spans, state, all_logits)
        except BaseException:
            for c in caches:
                c.restore()
            raise
        for c, item in zip(caches, batch, strict=True):
            c.length += item.num_tokens
        self.timings.forwards += 1
        self.timings.tokens += sum(b.num_tokens for b in batch)
        self.timings.seconds += time.monotonic() - t0
        return outputs

    def _input(self, batch: list[SeqInput], caches: list[SequenceCache]) -> tuple[ResidualState, list[Span]]:
        spans, start = [], 0
        for item, cache in zip(batch, caches, strict=True):
            spans.append(Span(start, item.num_tokens, cache))
            start += item.num_tokens
        if self.first:
            ids = torch.cat([b.ids for b in batch]).to(self.device, torch.long)  # type: ignore[misc]
            return embed(self.top, ids, self.dtype), spans  # type: ignore[arg-type]
        states = [ResidualState(b.state.P.to(self.device, self.dtype), b.state.B.to(self.device, self.dtype))
                  for b in batch]  # type: ignore[union-attr]
        return ResidualState.cat(states), spans

    def _output(self, batch: list[SeqInput], spans: list[Span], state: ResidualState,
                all_logits: bool) -> list[SeqOutput]:
        if not self.last:
            return [SeqOutput(b.session_id, state=s) for b, s in zip(batch, state.split([s.length for s in spans]),
                                                                        strict=True)]
        if not all_logits:
            rows = torch.tensor([s.start + s.length - 1 for s in spans], device=state.P.device)
            state = ResidualState(state.P[rows], state.B[rows])
            spans = [Span(i, 1, s.cache) for i, s in enumerate(spans)]
        logits = head(self.cfg, self.top, state)  # type: ignore[arg-type]
        return [SeqOutput(b.session_id, logits=logits[s.start:s.start + s.length]) for b, s in zip(batch, spans,
                                                                                                     strict=True)]

    def close(self) -> None:
        self.sessions.clear()
        self.experts.close()


def split_layers(cfg: ModelConfig, n: int) -> list[tuple[int, int]]:
    """Split the layers into n contiguous, near-equal ranges (the in-process `--stages N`)."""
    if not 1 <= n <= cfg.num_layers:
        raise DeltafinError(f"--stages must be between 1 and the number of layers ({cfg.num_layers})")
    bounds = [round(i * cfg.num_layers / n) for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]
