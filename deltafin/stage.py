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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from deltafin.checkpoint import Checkpoint
from deltafin.config import ModelConfig
from deltafin.errors import DeltafinError
from deltafin.kernels.linear import Weight
from deltafin.models.attn_res import ResidualState
from deltafin.models.cache import SequenceCache, cache_bytes_per_token, cache_fixed_bytes, new_sequence_cache
from deltafin.models.decoder import Span, decoder_layer, embed, ffn_input, head
from deltafin.models.moe import route
from deltafin.models.weights import ExpertWeights
from deltafin.quant import Int8Weight, quantize_int8_rows
from deltafin.weights.reader import ShardFiles
from deltafin.weights.spine import SpineStore, plan_spine
from deltafin.weights.store import ExpertStore

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


class Cancelled(StageError):
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


@dataclass(frozen=True)
class StageOptions:
    """How a stage holds its weights. Defaults: everything resident, fp32 activations."""

    dtype: torch.dtype = torch.float32  # activations (and dense matrices on GPUs)
    memory_bytes: int | None = None  # budget for resident weights: spine (+ experts when all are resident)
    spine: str = "bf16"  # "bf16": as stored (or the compute dtype); "int8": row-int8, dequantized on use
    expert_cache_bytes: int | None = None  # None: every expert resident; else stream them with this cache
    io: str = "direct"  # expert and streamed-spine reads: "direct" (no page cache) or "buffered"
    read_threads: int = 8
    cache_policy: str = "lfu"  # measured best of lru/lfu/pinned on decode traces (README)
    prefetch: bool = True
    prefetch_layers: int = 2  # predict the current MoE layer's experts (1) and the next one's too (2)
    session_bytes: int | None = None  # per-stage budget for session caches (KDA state, MLA latents)

    @property
    def streaming(self) -> bool:
        return self.expert_cache_bytes is not None


@dataclass
class StageTimings:
    forwards: int = 0
    tokens: int = 0
    seconds: float = 0.0


class Stage:
    def __init__(self, ckpt: Checkpoint, start: int, end: int, *, device: torch.device,
                 options: StageOptions | None = None, experts: ExpertProvider | None = None,
                 progress: Callable[[str, float], None] | None = None):
        cfg = ckpt.config
        opts = options or StageOptions()
        if not 0 <= start < end <= cfg.num_layers:
            raise DeltafinError(f"invalid layer range [{start}, {end}) for a {cfg.num_layers}-layer model")
        if opts.spine not in ("bf16", "int8"):
            raise DeltafinError(f"unknown spine format {opts.spine!r}: use bf16 or int8")
        self.cfg, self.ckpt, self.start, self.end = cfg, ckpt, start, end
        self.device, self.dtype, self.options = device, opts.dtype, opts
        self.first, self.last = start == 0, end == cfg.num_layers
        ckpt.raise_problems(layers=range(start, end), top=self.first or self.last)
        t0 = time.monotonic()
        self.files = ShardFiles(opts.io)
        spine_budget = opts.memory_bytes
        if spine_budget is not None and not opts.streaming and experts is None:
            spine_budget -= self._all_experts_bytes()
            if spine_budget <= 0:
                raise OutOfMemory(
                    f"every expert of layers [{start}, {end}) needs {self._all_experts_bytes() / 1e9:.2f} GB but the "
                    f"memory budget is {opts.memory_bytes / 1e9:.2f} GB: stream experts (--expert-cache-gb) or give "
                    "this stage fewer layers")
        plan = plan_spine(self.layers_range, self._placed_bytes, self._stored_bytes, self._top_bytes(), spine_budget)
        self.spine = SpineStore(ckpt, self.layers_range, self._place, plan, self.files, first=self.first,
                                last=self.last, progress=progress, threads=opts.read_threads)
        self.spine.stream_place = self._place_streamed
        self.top = self.spine.top
        if experts is None:
            moe = [i for i in self.layers_range if cfg.is_moe(i)]
            if opts.streaming:
                experts = ExpertStore(ckpt, moe, device=device, place_matrix=self._place_matrix,
                                      cache_bytes=opts.expert_cache_bytes or 0, io=opts.io,
                                      threads=opts.read_threads, policy=opts.cache_policy, prefetch=opts.prefetch)
            else:
                from deltafin.weights.resident import ResidentExperts

                experts = ResidentExperts(ckpt, moe, self._place_matrix)
        self.experts = experts
        log.info("stage [%d, %d) on %s in %.1fs: spine %.2f GB resident (%d layers), %d streamed; experts %s",
                 start, end, device, time.monotonic() - t0, plan.resident_bytes / 1e9, len(plan.resident),
                 len(plan.streamed), "streamed" if opts.streaming else "resident")
        self.sessions: OrderedDict[str, SequenceCache] = OrderedDict()
        self.evicted: OrderedDict[str, str] = OrderedDict()  # session id -> why, for a clear error later
        self.last_used: dict[str, float] = {}  # session id -> monotonic time of its last forward
        self.timings = StageTimings()

    @property
    def layers_range(self) -> range:
        return range(self.start, self.end)

    @property
    def blocks_in(self) -> int:
        return self.cfg.blocks_entering(self.start)

    @property
    def cache_budget(self) -> int | None:
        return self.options.session_bytes

    # ---- weights -----------------------------------------------------------------------------------

    def _keeps_stored(self, t: torch.Tensor) -> bool:
        """On the CPU, bf16 matrices stay bf16 under fp32 activations: the kernels multiply them exactly."""
        return self.device.type == "cpu" and t.dtype == torch.bfloat16

    def _place(self, t: torch.Tensor, role: str) -> Weight:
        if role == "vector":
            return t.to(self.device, torch.float32)
        if role == "embedding":
            return t.to(self.device)
        if role == "dense":
            return t.to(self.device, self.dtype)
        if role == "matrix" and self.options.spine == "int8" and t.dim() == 2 and min(t.shape) > 1:
            q = quantize_int8_rows(t)
            return Int8Weight(q.q.to(self.device), q.scale.to(self.device))
        return self._place_matrix(t)

    def _place_streamed(self, t: torch.Tensor, role: str) -> Weight:
        """Streamed layers stay as stored: quantizing them on every pass would cost more than it saves."""
        return self._place(t, role) if role != "matrix" else self._place_matrix(t)

    def _place_matrix(self, t: torch.Tensor) -> torch.Tensor:
        if self._keeps_stored(t):
            return t if t.device == self.device else t.to(self.device)
        return t.to(self.device, self.dtype)

    def _placed_bytes(self, layer: int) -> int:
        """Resident footprint of a layer's spine as `_place` will hold it."""
        size = torch.finfo(self.dtype).bits // 8
        total = 0
        for s in self.cfg.layer_tensor_specs(layer):
            if len(s.shape) == 1 or s.dtype == "F32" or 1 in s.shape:
                total += s.numel * 4
            elif s.name.endswith("kv_b_proj.weight"):
                total += s.numel * size
            elif self.options.spine == "int8":
                total += s.numel + 2 * s.shape[0]
            elif self.device.type == "cpu" and s.dtype == "BF16":
                total += s.numel * 2
            else:
                total += s.numel * size
        return total

    def _stored_bytes(self, layer: int) -> int:
        return sum(s.nbytes for s in self.cfg.layer_tensor_specs(layer))

    def _top_bytes(self) -> int:
        size = torch.finfo(self.dtype).bits // 8
        total = 0
        for s in self.cfg.top_tensor_specs():
            if self.first and "embed_tokens" in s.name:
                total += s.nbytes
            elif self.last and "embed_tokens" not in s.name:
                total += s.numel * (2 if self.device.type == "cpu" and s.dtype == "BF16" else size)
        return total

    def _all_experts_bytes(self) -> int:
        return sum(self.cfg.num_experts * self.cfg.bytes_per_expert for i in self.layers_range if self.cfg.is_moe(i))

    def spine_bytes(self) -> int:
        return self.spine.plan.total_bytes

    # ---- sessions ----------------------------------------------------------------------------------

    def release(self, session_id: str) -> bool:
        """Free a session's caches; False if it did not exist."""
        self.evicted.pop(session_id, None)
        self.last_used.pop(session_id, None)
        return self.sessions.pop(session_id, None) is not None

    def session_bytes(self) -> int:
        return sum(c.nbytes for c in self.sessions.values())

    def expire(self, idle_seconds: float, now: float | None = None) -> list[str]:
        """Drop sessions unused for `idle_seconds` (a coordinator that vanished never releases them)."""
        now = time.monotonic() if now is None else now
        gone = [sid for sid, t in self.last_used.items() if now - t > idle_seconds]
        for sid in gone:
            self.sessions.pop(sid, None)
            self.last_used.pop(sid, None)
            self._note_evicted(sid, f"expired after {idle_seconds:.0f}s without use")
        return gone

    def _note_evicted(self, sid: str, why: str) -> None:
        self.evicted[sid] = why
        while len(self.evicted) > 4096:
            self.evicted.popitem(last=False)

    def _session(self, item: SeqInput, pinned: set[str]) -> SequenceCache:
        sid = item.session_id
        if item.cache_len == 0:
            self.sessions.pop(sid, None)
            self.evicted.pop(sid, None)
            self._make_room(item.num_tokens, pinned)
            cache = new_sequence_cache(self.cfg, self.layers_range, self.device, self.dtype,
                                       mla_capacity=max(64, item.num_tokens))
            self.sessions[sid] = cache
            self.last_used[sid] = time.monotonic()
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
        self.last_used[sid] = time.monotonic()
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
            self.last_used.pop(sid, None)
            self._note_evicted(sid, f"evicted to make room: the stage cache budget is {self.cache_budget / 1e9:.2f} GB")
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
    def forward(self, batch: list[SeqInput], all_logits: bool = False,
                should_stop: Callable[[], bool] | None = None) -> list[SeqOutput]:
        """Run the stage on a batch of sequences. The last stage returns logits for the last token of
        each sequence (or every token with `all_logits`); the others return the residual state.
        `should_stop` is asked between layers: if it says so, Cancelled is raised and no session changes."""
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
                if should_stop is not None and should_stop():
                    raise Cancelled("the forward was cancelled")
                weights = self.spine.layer(layer)
                self.spine.prefetch_after(layer)
                self._prefetch_experts(layer, state)
                state = decoder_layer(self.cfg, layer, weights, state, spans, self.experts.experts)
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

    def _prefetch_experts(self, layer: int, state: ResidualState) -> None:
        """Predict this layer's and the next one's experts from the current residual (their routers applied
        to their mixes of it) and queue the reads behind every demand read."""
        prefetch = getattr(self.experts, "prefetch", None)
        if prefetch is None or not self.options.prefetch:
            return
        for target in (layer, layer + 1)[:self.options.prefetch_layers]:
            if target in self.layers_range and self.cfg.is_moe(target) and self.spine.is_ready(target):
                w = self.spine.layer(target)
                idx, weights = route(self.cfg, w.ffn, ffn_input(self.cfg, w, state))  # type: ignore[arg-type]
                order = weights.flatten().argsort(descending=True)  # the most confident guesses first
                prefetch(target, list(dict.fromkeys(idx.flatten()[order].tolist())))

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

    def stats(self) -> dict[str, object]:
        """Counters: tokens, seconds, and the expert store's and spine's I/O (when they stream)."""
        out: dict[str, object] = {"forwards": self.timings.forwards, "tokens": self.timings.tokens,
                                  "seconds": round(self.timings.seconds, 4),
                                  "spine_streamed_bytes": self.spine.streamed_bytes,
                                  "spine_wait_s": round(self.spine.wait_s, 4)}
        snapshot = getattr(self.experts, "snapshot_stats", None)
        if snapshot is not None:
            experts = snapshot()
            out["experts"] = experts.as_dict()
            out["compute_s"] = round(self.timings.seconds - experts.io_wait_s - self.spine.wait_s, 4)
        return out

    def close(self) -> None:
        self.sessions.clear()
        self.last_used.clear()
        self.experts.close()
        self.spine.close()
        self.files.close()


def split_layers(cfg: ModelConfig, n: int) -> list[tuple[int, int]]:
    """Split the layers into n contiguous, near-equal ranges (the in-process `--stages N`)."""
    if not 1 <= n <= cfg.num_layers:
        raise DeltafinError(f"--stages must be between 1 and the number of layers ({cfg.num_layers})")
    bounds = [round(i * cfg.num_layers / n) for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]
