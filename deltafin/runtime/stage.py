"""A Stage runs layers [start, end) of the model for a batch of sequences (DESIGN.md, the stage contract).

Stage 0 also embeds token ids; the last stage also applies the final mix, norm and head. Between stages
only the residual state travels. Per-session caches live here, with ids, a byte budget, LRU eviction
with a clear error for the evicted session, and explicit release. A forward that fails half-way leaves
every session as it was before the call.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from deltafin.checkpoint.config import LayerKind, ModelConfig
from deltafin.checkpoint.manifest import check_held
from deltafin.checkpoint.shards import Checkpoint, fingerprint, open_copy
from deltafin.errors import (
    Cancelled,
    DeltafinError,
    InvalidInput,
    OutOfMemory,
    PrefixNotFound,
    SessionNotFound,
    SessionOutOfSync,
    SizingError,
)
from deltafin.kernels.linear import Weight, expert_backend
from deltafin.kernels.quant import Int8Weight, quantize_int8_rows
from deltafin.models.attn_res import ResidualState
from deltafin.models.cache import SequenceCache, new_sequence_cache
from deltafin.models.common import activation
from deltafin.models.decoder import (
    PIECE_TOKENS,
    Span,
    decoder_layer,
    embed,
    ffn_input,
    head,
    layer_in_pieces,
    pieces_of,
)
from deltafin.models.kda import delta_rule_recurrent
from deltafin.models.moe import FusedExperts, route, routed_outputs
from deltafin.models.weights import ExpertWeights
from deltafin.plan.sizing import (
    SPECULATIVE_TOKENS,
    Budget,
    Placement,
    StageSizing,
    choose,
    expert_slot_bytes,
    matrix_format,
    sequence_bytes,
    size_stage,
)
from deltafin.runtime.prefix_disk import PrefixDisk
from deltafin.runtime.prefix_store import PrefixStore
from deltafin.runtime.stage_options import StageOptions
from deltafin.runtime.wide import WideExperts
from deltafin.weights.diskspeed import measure_disk
from deltafin.weights.reader import ShardFiles, layer_spans
from deltafin.weights.resident import ResidentExperts
from deltafin.weights.spine import SpinePlan, SpineStore
from deltafin.weights.store import ExpertStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SeqInput:
    """One sequence of a forward call: `ids` [T] for stage 0, else the residual state of T tokens."""

    session_id: str
    cache_len: int  # tokens already in the session's cache (0 starts a new session)
    ids: torch.Tensor | None = None
    state: ResidualState | None = None
    resume_from: str | None = None  # a new session starts from this prefix (of cache_len tokens)
    save_as: str | None = None  # after this forward, keep the session's state as this prefix too
    # drafted tokens to verify: logits for every token come back, and the next forward may continue from any
    # of its positions (cache_len below the session's length drops the drafts after it)
    speculative: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0]) if self.ids is not None else self.state.num_tokens  # type: ignore[union-attr]

    def carrying(self, state: ResidualState) -> SeqInput:
        """The same sequence for the next stage: the previous stage's output instead of ids."""
        return dataclasses.replace(self, ids=None, state=state)


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
    experts_s: float = 0.0  # of which producing the routed experts' outputs (reads, compute, waiting for holders)


def plan_stage(cfg: ModelConfig, start: int, end: int, device: torch.device, options: StageOptions,
               spans: tuple[int, ...] | None = None, experts: str = "torch") -> StageSizing:
    """What the stage will hold (pure): within `memory_bytes` if set, else everything resident; `experts`
    is where the routed experts run (torch or mlx)."""
    place = Placement(device.type, torch.finfo(options.dtype).bits // 8, experts)
    sizing = options.sizing_for(spans)
    if options.memory_bytes is None:
        spine = "bf16" if options.sizing.spine == "auto" else options.sizing.spine
        return size_stage(cfg, start, end, place, spine, options.sizing.expert_cache_bytes, end - start, sizing)
    try:
        return choose(cfg, start, end, place, Budget(options.memory_bytes, options.host_memory_bytes), sizing)
    except SizingError as e:
        raise OutOfMemory(str(e)) from None


def open_experts(ckpt: Checkpoint, sizing: StageSizing, options: StageOptions, device: torch.device,
                 layers: Iterable[int], backend: str) -> ExpertProvider:
    """The routed experts of `layers` as the plan says: streamed through a cache (from the model's disk and any
    `expert_dir`), or resident (on MLX, or torch)."""
    cfg, layers = ckpt.config, list(layers)
    if sizing.streaming:
        copies = [open_copy(ckpt, d) for d in options.expert_dir]
        speeds = options.disk_gbps
        if speeds is None and copies:
            speeds = tuple(measure_disk(c, options.sizing.read_threads, options.io) for c in (ckpt, *copies))
            log.info("expert disks: %s", ", ".join(f"{c.model_dir} {g:.2f} GB/s"
                                                    for c, g in zip((ckpt, *copies), speeds, strict=True)))
        return ExpertStore(ckpt, layers, device=device, cache_bytes=sizing.expert_cache, io=options.io,
                           threads=options.sizing.read_threads, policy=options.cache_policy, prefetch=options.prefetch,
                           backend=backend, act=activation(cfg), copies=copies, disk_gbps=speeds,
                           demand_layers=2 if options.sizing.expert_layers is not None and not sizing.holder_only else 1)
    if backend == "mlx":
        from deltafin.weights.mlx_slots import MLXResidentExperts

        return MLXResidentExperts(ckpt, layers, activation(cfg), io=options.io)
    return ResidentExperts(ckpt, layers, device, io=options.io)


class Stage:
    def __init__(self, ckpt: Checkpoint, start: int, end: int, *, device: torch.device,
                 options: StageOptions | None = None, experts: ExpertProvider | None = None,
                 progress: Callable[[str, float], None] | None = None, serves: Iterable[int] | None = None):
        """`serves`: with wide experts, the MoE layers (its own and others') whose share this worker's store
        holds; the stage then computes its layers' experts through `wide` (set_wide), never alone."""
        cfg = ckpt.config
        opts = options or StageOptions()
        if not 0 <= start < end <= cfg.num_layers:
            raise DeltafinError(f"invalid layer range [{start}, {end}) for a {cfg.num_layers}-layer model")
        self.cfg, self.ckpt, self.start, self.end = cfg, ckpt, start, end
        self.device, self.dtype, self.options = device, opts.dtype, opts
        self.first, self.last = start == 0, end == cfg.num_layers
        _check_held(ckpt, start, end, self.first or self.last, serves)
        self.expert_backend = expert_backend_for(cfg, device) if experts is None else "given"
        # refuses what cannot fit, before anything loads
        self.sizing = plan_stage(cfg, start, end, device, opts, layer_spans(ckpt),
                                 "mlx" if self.expert_backend == "mlx" else "torch")
        self._log_plan(opts)
        t0 = time.monotonic()
        self.files = ShardFiles(opts.io)
        plan = SpinePlan(self.sizing.resident_layers, self.sizing.streamed_layers,
                         self.sizing.layers + self.sizing.top, self.sizing.stream_buffers)
        self.spine = SpineStore(ckpt, self.layers_range, self._place, plan, self.files, first=self.first,
                                last=self.last, progress=progress, threads=opts.sizing.read_threads)
        self.spine.stream_place = self._place_streamed
        self.top = self.spine.top
        self.wide: WideExperts | None = None
        served = [i for i in self.layers_range if cfg.is_moe(i)] if serves is None else sorted(serves)
        self.experts = experts if experts is not None else open_experts(ckpt, self.sizing, opts, device, served,
                                                                        self.expert_backend)
        log.info("stage [%d, %d) loaded in %.1fs: spine %s, %d layers resident, %d streamed; experts %s",
                 start, end, time.monotonic() - t0, self.sizing.spine, len(plan.resident), len(plan.streamed),
                 "streamed" if self.sizing.streaming else "resident")
        self.sessions: OrderedDict[str, SequenceCache] = OrderedDict()
        self.evicted: OrderedDict[str, str] = OrderedDict()  # session id -> why, for a clear error later
        self.last_used: dict[str, float] = {}  # session id -> monotonic time of its last forward
        self.prefixes, self.tokens = PrefixStore(self.sizing.prefixes, self._prefix_disk()), {}
        self.timings = StageTimings()

    def set_wide(self, wide: WideExperts | None) -> None:
        """Compute this stage's routed experts through every holder (wide) or, with None, alone."""
        if wide is None and self.options.sizing.expert_layers is not None:
            raise DeltafinError("a stage planned for wide experts holds only its share: it needs its holders")
        self.wide = wide

    def _prefix_disk(self) -> PrefixDisk | None:
        """Where kept prefixes go on the disk (`prefix_dir`), in a folder of this stage's identity."""
        opts = self.options
        if not opts.prefix_dir or not opts.prefix_disk_bytes or not self.sizing.prefixes:
            return None
        dtype = str(self.dtype).removeprefix("torch.")
        identity = f"{fingerprint(self.ckpt.model_dir)}-{self.start}-{self.end}-{dtype}-{self.device.type}"
        return PrefixDisk(opts.prefix_dir, identity, opts.prefix_disk_bytes, self.device)

    @property
    def layers_range(self) -> range:
        return range(self.start, self.end)

    @property
    def blocks_in(self) -> int:
        return self.cfg.blocks_entering(self.start)

    @property
    def cache_budget(self) -> int | None:
        """Bytes for session caches: the plan's (with a memory budget), else what the options say."""
        return self.sizing.sessions if self.options.memory_bytes is not None else self.options.sizing.session_bytes

    @property
    def max_forward_tokens(self) -> int | None:
        """Tokens one forward may carry (None: no limit, without a memory budget)."""
        return self.sizing.forward_tokens if self.options.memory_bytes is not None else None

    # ---- weights -----------------------------------------------------------------------------------

    def _place(self, t: torch.Tensor, role: str, resident: bool = True) -> Weight:
        """Place a tensor as sizing.py counts it (roles: see models/weights.py)."""
        if role == "vector":
            return t.to(self.device, torch.float32)
        if role == "dense":
            return t.to(self.device, self.dtype)
        if (role == "matrix" and matrix_format(self.sizing.spine, resident) == "int8" and t.dim() == 2
                and min(t.shape) > 1):
            q = quantize_int8_rows(t)
            return Int8Weight(q.q.to(self.device), q.scale.to(self.device))
        if t.dtype in (torch.bfloat16, torch.float16):  # as stored: fp32 activations multiply it directly
            return t if t.device == self.device else t.to(self.device)
        return t.to(self.device, self.dtype)

    def _place_streamed(self, t: torch.Tensor, role: str) -> Weight:
        return self._place(t, role, resident=False)

    def spine_bytes(self) -> int:
        return self.spine.plan.total_bytes

    # ---- sessions ----------------------------------------------------------------------------------

    def release(self, session_id: str, keep_as: str | None = None, keep_length: int = 0) -> bool:
        """Free a session's caches, or with `keep_as` turn them into that prefix (nothing is copied), of its
        first `keep_length` tokens if given (a position of its last speculative forward); an id that names a
        prefix instead drops it. False if neither existed."""
        self.evicted.pop(session_id, None)
        self.last_used.pop(session_id, None)
        tokens = self.tokens.pop(session_id, None)
        cache = self.sessions.pop(session_id, None)
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

    def session_bytes(self) -> int:
        """What the sessions hold against their budget: caches, and a speculative forward's trail until the next
        forward picks the position (planned room with `speculative_tokens`, else taken from the caches' room)."""
        return sum(c.nbytes + c.trail_bytes for c in self.sessions.values())

    def expire(self, idle_seconds: float, now: float | None = None) -> list[str]:
        """Drop sessions unused for `idle_seconds` (a coordinator that vanished never releases them)."""
        now = time.monotonic() if now is None else now
        gone = [sid for sid, t in self.last_used.items() if now - t > idle_seconds]
        for sid in gone:
            self.sessions.pop(sid, None)
            self.last_used.pop(sid, None)
            self.tokens.pop(sid, None)
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
            self._make_room(sequence_bytes(self.cfg, self._n_kda, self._n_mla, item.num_tokens,
                                           torch.finfo(self.dtype).bits // 8), pinned)
            cache = new_sequence_cache(self.cfg, self.layers_range, self.device, self.dtype, item.num_tokens)
            self.sessions[sid] = cache
            self.last_used[sid] = time.monotonic()
            return cache
        cache = self.sessions.get(sid)
        if cache is None and item.resume_from:
            cache = self._resume(item, pinned)
        if cache is None:
            why = self.evicted.get(sid)
            raise SessionNotFound(f"session {sid!r} is not on this stage"
                                  + (f" ({why})" if why else "") + "; start it again with cache_len 0")
        if (cache.pending or cache.length != item.cache_len) and not cache.rewind(item.cache_len,
                                                                                delta_rule_recurrent):
            raise SessionOutOfSync(f"session {sid!r}: this stage holds {cache.length} tokens but the call says "
                                   f"{item.cache_len} (a replayed or concurrent call?)")
        self.sessions.move_to_end(sid)
        self.last_used[sid] = time.monotonic()
        self._make_room(cache.growth(item.num_tokens), pinned)
        return cache

    def _resume(self, item: SeqInput, pinned: set[str]) -> SequenceCache:
        """A new session from a kept prefix of exactly cache_len tokens."""
        kept = self.prefixes.get(item.resume_from or "", self.dtype)
        if kept is None:
            raise PrefixNotFound(f"prefix {item.resume_from!r} is not on stage [{self.start}, {self.end}) (evicted or "
                                 "never kept); start the session with cache_len 0")
        if kept.length != item.cache_len:
            raise InvalidInput(f"prefix {item.resume_from!r} holds {kept.length} tokens, not {item.cache_len}")
        self._make_room(kept.nbytes + kept.growth(item.num_tokens), pinned)
        cache = kept.resume(item.num_tokens)
        self.sessions[item.session_id] = cache
        known = self.prefixes.tokens_of(item.resume_from or "") if self.first else None
        if known is not None:
            self.tokens[item.session_id] = array("i", known)
        self.evicted.pop(item.session_id, None)
        self.prefixes.stats.resumed += 1
        return cache

    @property
    def _n_kda(self) -> int:
        return sum(1 for i in self.layers_range if self.cfg.layer_kinds[i] is LayerKind.KDA)

    @property
    def _n_mla(self) -> int:
        return sum(1 for i in self.layers_range if self.cfg.layer_kinds[i] is LayerKind.MLA)

    def _make_room(self, need: int, pinned: set[str]) -> None:
        """Evict least-recently-used sessions (not in this call) until `need` more bytes fit the budget."""
        if self.cache_budget is None:
            return
        for sid in list(self.sessions):
            if self.session_bytes() + need <= self.cache_budget:
                return
            if sid in pinned:
                continue
            self.sessions.pop(sid)
            self.last_used.pop(sid, None)
            self.tokens.pop(sid, None)
            self._note_evicted(sid, f"evicted to make room: the stage cache budget is {self.cache_budget / 1e9:.2f} GB")
            log.info("evicted session %s", sid)
        if self.session_bytes() + need > self.cache_budget:
            raise OutOfMemory(f"the session cache budget ({self.cache_budget / 1e9:.3f} GB) cannot hold this "
                              f"request's sequences ({(self.session_bytes() + need) / 1e9:.3f} GB)")

    # ---- forward -----------------------------------------------------------------------------------

    def _validate(self, item: SeqInput) -> None:
        if item.cache_len < 0:
            raise InvalidInput(f"session {item.session_id!r}: negative cache_len")
        if item.speculative and item.num_tokens > SPECULATIVE_TOKENS:
            raise InvalidInput(f"session {item.session_id!r}: a speculative forward verifies at most "
                               f"{SPECULATIVE_TOKENS} tokens (what a plan for drafting holds room for)")
        if item.speculative and item.save_as:
            raise InvalidInput(f"session {item.session_id!r}: a speculative forward cannot be kept as a prefix (its "
                               "drafts are not decided yet)")
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
                should_stop: Callable[[], bool] | None = None,
                progress: Callable[[int, int], None] | None = None) -> list[SeqOutput]:
        """Run the stage on a batch of sequences. The last stage returns logits for the last token of
        each sequence (or every token with `all_logits`); the others return the residual state.
        `should_stop` is asked between layers: if it says so, Cancelled is raised and no session changes;
        `progress(layers done, layers)` hears after each layer (a long prompt's forward takes minutes)."""
        self._validate_batch(batch, all_logits)
        t0 = time.monotonic()
        io_before = self._io_counters()
        if self.wide is not None:
            self.wide.begin_forward()
        pinned = {b.session_id for b in batch}
        caches = [self._session(item, pinned) for item in batch]
        for c, item in zip(caches, batch, strict=True):
            c.snapshot()
            if item.speculative:
                c.start_trail()
        try:
            state, spans = self._input(batch, caches)
            state = self._layers(state, spans, should_stop, progress)
            outputs = self._output(batch, spans, state, all_logits)
        except BaseException:
            for c in caches:
                c.restore()
                c.drop_trail()
            raise
        for c, item in zip(caches, batch, strict=True):
            c.length += item.num_tokens
            c.end_trail(item.num_tokens if item.speculative else 0)
            tokens = self._note_tokens(item)
            if item.save_as:
                self.prefixes.keep(item.save_as, c.share(), tokens[:c.length] if tokens is not None else None)
        self.timings.forwards += 1
        self.timings.tokens += sum(b.num_tokens for b in batch)
        self.timings.seconds += time.monotonic() - t0
        if log.isEnabledFor(logging.DEBUG):
            self._log_forward(batch, time.monotonic() - t0, io_before)
        return outputs

    def _note_tokens(self, item: SeqInput) -> array | None:
        """The first stage's record of a session's token ids, continued from where the forward started."""
        if not self.first:
            return None
        tokens = self.tokens.setdefault(item.session_id, array("i")) if item.cache_len == 0 or item.session_id in \
            self.tokens else None
        if tokens is None:  # resumed from a prefix whose tokens this stage never knew
            return None
        del tokens[item.cache_len:]
        tokens.extend(int(t) for t in item.ids.tolist())  # type: ignore[union-attr]
        return tokens

    def _log_plan(self, opts: StageOptions) -> None:
        """The plan's parts; with -v, the decisions behind it that set speed: forward size, the cache against the
        experts it serves, the spine."""
        s = self.sizing
        log.info("stage [%d, %d) on %s: %s", self.start, self.end, self.device, s.describe())
        served = s.expert_layers * self.cfg.num_experts * expert_slot_bytes(self.cfg) * s.expert_share
        cache = ("every expert resident" if s.experts_resident else
                 f"expert cache {s.expert_cache / 1e9:.2f} GB = {s.expert_cache / served:.1%} of the "
                 f"{served / 1e9:.1f} GB of experts it serves" if served else "no routed experts")
        log.debug("stage [%d, %d) plan: forwards of up to %d tokens (%s), %d sequences x %d tokens of context; %s; "
                  "spine %s, %d layers resident, %d streamed; policy %s, prefetch %s", self.start, self.end,
                  s.forward_tokens, "--prefill-chunk" if opts.sizing.prefill_chunk else "as long as the budget allows",
                  opts.sizing.sequences, opts.sizing.context, cache, s.spine, len(s.resident_layers), len(s.streamed_layers),
                  opts.cache_policy, "on" if opts.prefetch else "off")

    def _io_counters(self) -> tuple[float, ...]:
        """(seconds waiting for expert reads, expert lookups, cache hits, prefetch hits, demand reads, expert bytes
        read, seconds waiting for streamed spine, spine bytes streamed) so far."""
        spine = (self.spine.wait_s, self.spine.streamed_bytes)
        snapshot = getattr(self.experts, "snapshot_stats", None)
        if snapshot is None:
            return (0.0, 0, 0, 0, 0, 0, *spine)
        e = snapshot()
        return (e.io_wait_s, e.lookups, e.hits, e.prefetch_hits, e.misses, e.bytes_read, *spine)

    def _log_forward(self, batch: list[SeqInput], seconds: float, before: tuple[float, ...]) -> None:
        """-v: one line a forward with what it read and waited for (and, wide, each holder's experts and time)."""
        if not log.isEnabledFor(logging.DEBUG):
            return
        wait, lookups, hits, prefetched, misses, read, spine_wait, spine_read = (
            a - b for a, b in zip(self._io_counters(), before, strict=True))
        experts = (f"{int(lookups)} looked up: {int(hits)} cached, {int(prefetched)} prefetched, {int(misses)} "
                   f"demand reads; {read / 1e6:.1f} MB read, {wait:.3f}s waited" if lookups else "none streamed")
        spine = f"; spine {spine_read / 1e6:.1f} MB streamed, {spine_wait:.3f}s waited" if spine_read else ""
        log.debug("layers %d-%d: %d sequences, %d tokens in %.3fs (experts: %s%s)%s", self.start, self.end - 1,
                  len(batch), sum(b.num_tokens for b in batch), seconds, experts, spine,
                  f"; wide: {self.wide.describe_forward()}" if self.wide is not None else "")

    def _validate_batch(self, batch: list[SeqInput], all_logits: bool = False) -> None:
        if not batch or len({b.session_id for b in batch}) != len(batch):
            raise InvalidInput("a forward call needs at least one sequence and distinct session ids")
        if all_logits and self.last and sum(b.num_tokens for b in batch) > PIECE_TOKENS:
            raise InvalidInput(f"a forward that returns every position's logits carries at most {PIECE_TOKENS} "
                               "tokens (what the plan holds logits for): send it in pieces")
        for item in batch:
            self._validate(item)
        limit, tokens = self.max_forward_tokens, sum(b.num_tokens for b in batch)
        if limit is not None and tokens > limit:
            raise InvalidInput(f"this forward carries {tokens} tokens; stage [{self.start}, {self.end}) was sized for "
                               f"at most {limit} per forward: send longer prompts in chunks")

    def _layers(self, state: ResidualState, spans: list[Span], should_stop: Callable[[], bool] | None,
                progress: Callable[[int, int], None] | None = None) -> ResidualState:
        """The stage's layers in order, each one's weights (resident or streamed) and experts read ahead. A
        forward longer than one attention pass (PIECE_TOKENS rows) runs each layer's attention in pieces
        and its experts once over all of them (models/decoder.py, layer_in_pieces)."""
        pieces = pieces_of(spans, PIECE_TOKENS) if sum(s.length for s in spans) > PIECE_TOKENS else None
        for layer in self.layers_range:
            if should_stop is not None and should_stop():
                raise Cancelled("the forward was cancelled")
            weights = self.spine.layer(layer)
            self.spine.prefetch_after(layer)
            self._prefetch_experts(layer, state)
            fused = getattr(self.experts, "fused", None) if self.wide is None else None
            experts = {"fused": self._timed_fused(fused) if fused is not None else None,
                       "routed": None if fused is not None else self._timed_routed}
            if pieces is None:
                state = decoder_layer(self.cfg, layer, weights, state, spans, self.experts.experts, **experts)
            else:
                state = layer_in_pieces(self.cfg, layer, weights, state, pieces, self.experts.experts, **experts)
            if progress is not None:
                progress(layer + 1 - self.start, self.end - self.start)
        return state

    def _timed_routed(self, layer: int, z: torch.Tensor, idx: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The routed experts' outputs (wide: through every holder; else from this stage's store), timed: what the
        stage waits for once its shared experts are done."""
        finish = self.wide(layer, z, idx) if self.wide is not None else (
            lambda: routed_outputs(self.cfg, layer, z, idx, self.experts.experts))
        return lambda: self._counted(finish)

    def _timed_fused(self, fused: FusedExperts) -> FusedExperts:
        return lambda layer, z, idx, weights: self._counted(lambda: fused(layer, z, idx, weights))

    def _counted(self, experts: Callable[[], torch.Tensor]) -> torch.Tensor:
        t0 = time.monotonic()
        try:
            return experts()
        finally:
            self.timings.experts_s += time.monotonic() - t0

    def _prefetch_experts(self, layer: int, state: ResidualState) -> None:
        """Predict this layer's and the next one's experts from the current residual (their routers applied
        to their mixes of it) and queue the reads behind every demand read (wide: on every holder's disk)."""
        prefetch = getattr(self.experts, "prefetch", None)
        if (prefetch is None and self.wide is None) or not self.options.prefetch:
            return
        guesses = []
        for target in (layer, layer + 1)[:self.options.prefetch_layers]:
            if target in self.layers_range and self.cfg.is_moe(target) and self.spine.is_ready(target):
                w = self.spine.layer(target)
                idx, weights = route(self.cfg, w.ffn, ffn_input(self.cfg, w, state))  # type: ignore[arg-type]
                order = weights.flatten().argsort(descending=True)  # the most confident guesses first
                guesses.append((target, list(dict.fromkeys(idx.flatten()[order].tolist()))))
        if self.wide is not None:
            self.wide.prefetch(guesses)
        else:
            for target, ids in guesses:
                prefetch(target, ids)

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
        if not all_logits:  # the last token's, but every token's of a speculative sequence
            keep = [(s.start, s.length) if b.speculative else (s.start + s.length - 1, 1) for b, s in zip(batch, spans,
                                                                                                       strict=True)]
            rows = torch.tensor([r for start, n in keep for r in range(start, start + n)], device=state.P.device)
            state = ResidualState(state.P[rows], state.B[rows])
            at = [0, *itertools.accumulate(n for _, n in keep)]
            spans = [Span(at[i], n, s.cache) for i, ((_, n), s) in enumerate(zip(keep, spans, strict=True))]
        logits = head(self.cfg, self.top, state)  # type: ignore[arg-type]
        return [SeqOutput(b.session_id, logits=logits[s.start:s.start + s.length]) for b, s in zip(batch, spans,
                                                                                                     strict=True)]

    def stats(self) -> dict[str, object]:
        """Counters: tokens, seconds, and the expert store's and spine's I/O (when they stream)."""
        out: dict[str, object] = {"forwards": self.timings.forwards, "tokens": self.timings.tokens,
                                  "seconds": round(self.timings.seconds, 4),
                                  "experts_s": round(self.timings.experts_s, 4),
                                  "spine_streamed_bytes": self.spine.streamed_bytes,
                                  "spine_read_s": round(self.spine.stream_read_s, 4),
                                  "spine_wait_s": round(self.spine.wait_s, 4), **self.prefixes.as_dict()}
        snapshot = getattr(self.experts, "snapshot_stats", None)
        if snapshot is not None:
            experts = snapshot()
            out["experts"] = experts.as_dict()
            out["disks"] = self.experts.disk_stats()  # type: ignore[attr-defined]
            out["compute_s"] = round(self.timings.seconds - experts.io_wait_s - self.spine.wait_s, 4)
        return out

    def close(self) -> None:
        self.sessions.clear()
        self.prefixes.close()
        self.tokens.clear()
        self.last_used.clear()
        self.experts.close()
        self.spine.close()
        self.files.close()
        self.top = self.spine.top = None  # device memory goes with close, not with garbage collection


def _check_held(ckpt: Checkpoint, start: int, end: int, top: bool, serves: Iterable[int] | None) -> None:
    """The stage's tensors are in the checkpoint, and (local experts) a partial download holds all of its layers'
    experts; a wide stage's share is checked where the plan is known (assigned.py)."""
    ckpt.raise_problems(layers=range(start, end), top=top)
    if serves is None:
        check_held(ckpt.model_dir, ckpt.config, start, end, None)


def expert_backend_for(cfg: ModelConfig, device: torch.device) -> str:
    """torch or mlx (kernels.linear.expert_backend), MLX only once it passed its self-check."""
    if not cfg.moe_layers or expert_backend(device.type) != "mlx":
        return "torch"
    from deltafin.kernels.mlx_moe import verified

    return "mlx" if verified(activation(cfg)) else "torch"


def split_layers(cfg: ModelConfig, n: int) -> list[tuple[int, int]]:
    """Split the layers into n contiguous, near-equal ranges (the in-process `--stages N`)."""
    if not 1 <= n <= cfg.num_layers:
        raise DeltafinError(f"--stages must be between 1 and the number of layers ({cfg.num_layers})")
    bounds = [round(i * cfg.num_layers / n) for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]
