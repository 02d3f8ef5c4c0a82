"""A Stage runs layers [start, end) of the model for a batch of sequences (docs/DESIGN.md, the stage contract).

Stage 0 also embeds token ids; the last stage also applies the final mix, norm and head. Between stages
only the residual state travels. Per-session caches live in the stage's session table (runtime/sessions.py),
with ids, a byte budget, LRU eviction with a clear error for the evicted session, and explicit release. A
forward's inputs are checked before any session changes, and a forward that fails half-way leaves every session
as it was before the call. What the stage is built from (its plan, weights' placement, expert provider) is in
runtime/stage_build.py; its counters and -v lines in runtime/stage_stats.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from deltafin.checkpoint.shards import Checkpoint
from deltafin.errors import Cancelled, DeltafinError
from deltafin.models.attn_res import ResidualState
from deltafin.models.cache import SequenceCache
from deltafin.models.decoder import (
    Piece,
    Span,
    decoder_layer,
    embed,
    final_hidden,
    head,
    layer_in_pieces,
    layer_input,
    pieces_of,
)
from deltafin.models.mode_routing import mode_router
from deltafin.models.moe import FusedExperts, routed_sum
from deltafin.models.pieces import PIECE_TOKENS, STREAM_PIECE_TOKENS
from deltafin.paths import cache_dir
from deltafin.plan.memory.stage_plan import StagePlan
from deltafin.runtime.features import FeatureCapture
from deltafin.runtime.prefix_store import HeldPrefixes, PrefixStore
from deltafin.runtime.read_ahead import prefetch_experts, room_for_prompt
from deltafin.runtime.sessions import Sessions
from deltafin.runtime.spill import SpilledBlocks, open_spill
from deltafin.runtime.stage_build import (
    ExpertProvider,
    WeightPlacer,
    check_stage_held,
    expert_backend_for,
    open_experts,
    plan_with_spine,
    prefix_disk_for,
    state_identity,
)
from deltafin.runtime.stage_io import SeqInput, SeqOutput, check_batch
from deltafin.runtime.stage_options import StageOptions
from deltafin.runtime.stage_stats import StageTimings, forward_reads, io_counters, plan_details, stage_stats
from deltafin.runtime.wide import WideExperts
from deltafin.runtime.worker_stats import StageStats
from deltafin.weights.reader import ShardFiles
from deltafin.weights.spine import SpinePlan, SpineStore
from deltafin.weights.spine_convert import rebuild_unit

log = logging.getLogger(__name__)


class Stage:
    """Layers [start, end) over their spine, routed experts and sessions (see the module docstring)."""

    def __init__(self, ckpt: Checkpoint, start: int, end: int, *, device: torch.device,
                 options: StageOptions | None = None, plan: StagePlan | None = None,
                 experts: ExpertProvider | None = None, progress: Callable[[str, float], None] | None = None,
                 serves: Iterable[int] | Mapping[int, range] | None = None):
        """`plan`: what the stage holds, as the planner made it (None: planned here, within `options`' budget);
        `serves`: with wide experts, the MoE layers (its own and others') whose share (by layer: a low-bit copy's)
        this worker's store holds; the stage then computes its layers' experts through `wide`, never alone."""
        cfg = ckpt.config
        opts = options or StageOptions()
        if not 0 <= start < end <= cfg.num_layers:
            raise DeltafinError(f"invalid layer range [{start}, {end}) for a {cfg.num_layers}-layer model")
        self.cfg, self.ckpt, self.start, self.end = cfg, ckpt, start, end
        self.device, self.dtype, self.options = device, opts.torch_dtype, opts
        self.first, self.last = start == 0, end == cfg.num_layers
        check_stage_held(ckpt, start, end, self.first or self.last, serves)
        self.expert_backend = expert_backend_for(cfg, device, opts.mode) if experts is None else "given"
        # refuses what cannot fit, before anything loads
        self.plan, self.spine_files = plan_with_spine(ckpt, start, end, device, opts, self.expert_backend, plan)
        self.budgeted = opts.memory_bytes is not None  # its plan's caches and forwards bind (without a budget the
        # plan is nominal: everything resident, no limit of its own)
        _log_plan(self)
        t0 = time.monotonic()
        self.files = ShardFiles(opts.io)
        self.spine = self._open_spine(progress)
        self.top = self.spine.top
        self.wide: WideExperts | None = None
        own = [i for i in self.layers_range if cfg.is_moe(i)]
        self.experts = experts if experts is not None else open_experts(
            ckpt, self.plan, opts, device, own if serves is None else serves, self.expert_backend, progress)
        self.router = mode_router(cfg, opts.mode, getattr(self.experts, "held", None))  # None: exact
        log.info("stage [%d, %d) loaded in %.1fs: spine %s, %d layers resident, %d streamed; experts %s",
                 start, end, time.monotonic() - t0, self.plan.spine, len(self.spine.plan.resident),
                 len(self.spine.plan.streamed), "streamed" if self.plan.streaming else "resident")
        self.identity = state_identity(ckpt, start, end, device, opts, self.plan, self.expert_backend)
        disk = prefix_disk_for(ckpt, device, opts, self.plan, self.identity)
        self.prefixes = PrefixStore(self.plan.prefixes, disk)
        self.sessions = Sessions(cfg, self.layers_range, device, self.dtype, self.cache_budget, self.prefixes,
                                 first=self.first)
        self.timings = StageTimings()
        self.spill_dir = Path(opts.spill_dir) if opts.spill_dir else cache_dir("spill")

    def _open_spine(self, progress: Callable[[str, float], None] | None) -> SpineStore:
        """The spine's layers as the plan holds them: resident ones placed now, streamed ones as they are read."""
        s = self.plan
        plan = SpinePlan(s.resident_layers, s.streamed_layers, s.layers + s.top, s.stream_buffers)
        placer = WeightPlacer.of(s, self.device, self.dtype)
        source = self.spine_files
        repair = None if source is None or not self.options.convert else \
            lambda unit: rebuild_unit(self.ckpt, source, unit)
        spine = SpineStore(self.ckpt, self.layers_range, placer.place, plan, self.files, first=self.first,
                           last=self.last, progress=progress, threads=self.options.sizing.read_threads,
                           source=source, repair=repair)
        spine.stream_place = placer.place_streamed
        return spine

    def set_wide(self, wide: WideExperts | None) -> None:
        """Compute this stage's routed experts through every holder (wide) or, with None, alone."""
        if wide is None and self.plan.wide:
            raise DeltafinError("a stage planned for wide experts holds only its share: it needs its holders")
        self.wide = wide

    @property
    def layers_range(self) -> range:
        return range(self.start, self.end)

    @property
    def blocks_in(self) -> int:
        return self.cfg.blocks_entering(self.start)

    @property
    def cache_budget(self) -> int | None:
        """Bytes for session caches: the plan's (with a memory budget), else what the options say."""
        return self.plan.sessions if self.budgeted else None

    @property
    def max_forward_tokens(self) -> int | None:
        """Tokens one forward may carry (None: no limit, without a memory budget): a prompt's, whose forward longer
        than the plan's `forward_tokens` borrows the expert cache (runtime/read_ahead.py), one longer than its
        `prompt_tokens` spills its rows' blocks to the disk (runtime/spill.py)."""
        return self.plan.longest_forward if self.budgeted else None

    def spine_bytes(self) -> int:
        return self.spine.plan.total_bytes

    # ---- sessions (runtime/sessions.py) --------------------------------------------------------------

    def release(self, session_id: str, keep_as: str | None = None, keep_length: int = 0) -> bool:
        """Free a session's caches, or keep them as the prefix `keep_as` (Sessions.release)."""
        return self.sessions.release(session_id, keep_as, keep_length)

    def held_prefixes(self, prefix_ids: list[str], logits_for: str | None = None) -> HeldPrefixes:
        """Which of `prefix_ids` this stage holds (memory or disk), and on the last stage the logits kept with
        `logits_for` (a prompt kept whole: a request for exactly it feeds no prompt token)."""
        held = self.prefixes.held(prefix_ids)
        logits = self.prefixes.logits(logits_for) if self.last and logits_for in held else None
        return HeldPrefixes(held, logits)

    def session_bytes(self) -> int:
        """What the sessions hold against their budget (Sessions.nbytes)."""
        return self.sessions.nbytes

    def expire(self, idle_seconds: float, now: float | None = None) -> list[str]:
        """Drop sessions unused for `idle_seconds` (a coordinator that vanished never releases them)."""
        return self.sessions.expire(idle_seconds, now)

    # ---- forward -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: list[SeqInput], all_logits: bool = False,
                should_stop: Callable[[], bool] | None = None,
                progress: Callable[[int, int], None] | None = None,
                early: Callable[[list[SeqOutput]], None] | None = None) -> list[SeqOutput]:
        """Run the stage on a batch of sequences: the last stage returns logits for each one's last token (every
        token's with `all_logits`), the others the residual state. `should_stop` is asked between layers (Cancelled:
        no session changes); `progress(layers done, layers)` hears after each layer. `early` hears outputs final
        before the forward ends (slices of states, in order): a long forward's last layer, where it is dense, runs
        in pieces (models/decoder.py STREAM_PIECE_TOKENS), each passed on as it is done, to cross meanwhile."""
        check_batch(self.cfg, self.start, self.end, batch, self.max_forward_tokens, all_logits)
        tokens = sum(b.num_tokens for b in batch)
        blocks = open_spill(self, tokens)  # where it spills: its disk has the room
        room_for_prompt(self, tokens)
        t0 = time.monotonic()
        io_before = io_counters(self.spine, self.experts)
        if self.wide is not None:
            self.wide.begin_forward()
        caches = self.sessions.open_forward(batch)
        try:
            state, spans = self._input(batch, caches)
            capture = _capture(self, batch, spans)
            done = None if early is None else (lambda piece, rows: early(_piece_outputs(self, batch, spans, piece,
                                                                                      rows, capture)))
            state = self._layers(state, spans, should_stop, progress, capture, done, blocks)
            outputs = _outputs(self, batch, spans, state, all_logits, capture, blocks)
        except BaseException:
            for c in caches:
                c.restore()
                c.drop_trail()
            raise
        finally:
            if blocks is not None:
                blocks.close()
        self._advance(batch, caches, outputs)
        self.timings.forwards += 1
        self.timings.tokens += sum(b.num_tokens for b in batch)
        self.timings.seconds += time.monotonic() - t0
        if log.isEnabledFor(logging.DEBUG):
            _log_forward(self, batch, time.monotonic() - t0, io_before)
        return outputs

    def _advance(self, batch: list[SeqInput], caches: list[SequenceCache], outputs: list[SeqOutput]) -> None:
        """After a forward that succeeded: each session holds its tokens (a speculative one, the trail to rewind
        with), the first stage records their ids, and `save_at` keeps states as prefixes too."""
        for c, item, out in zip(caches, batch, outputs, strict=True):
            c.length += item.num_tokens
            c.end_trail(item.num_tokens if item.speculative else 0)
            tokens = self.sessions.record_tokens(item.session_id, item.cache_len, item.ids)
            _keep_states(self.prefixes, c, item, out, tokens)

    def _layers(self, state: ResidualState, spans: list[Span], should_stop: Callable[[], bool] | None,
                progress: Callable[[int, int], None] | None = None,
                capture: FeatureCapture | None = None,
                done: Callable[[Piece, ResidualState], None] | None = None,
                blocks: SpilledBlocks | None = None) -> ResidualState:
        """The stage's layers in order, each one's weights and experts read ahead; a forward over PIECE_TOKENS rows
        runs attention in pieces, its experts once over all (models/decoder.py, layer_in_pieces). `capture` takes
        the hidden states entering the layers it asks for (and the final one); `done` hears the dense last layer's
        pieces as they are final (see `forward`); `blocks`: a spilled forward's rows' blocks (its state has none)."""
        tokens = sum(s.length for s in spans)
        pieces = pieces_of(spans, PIECE_TOKENS) if tokens > PIECE_TOKENS else None
        streams = done is not None and not self.last and tokens > STREAM_PIECE_TOKENS and \
            not self.cfg.is_moe(self.end - 1)
        if blocks is None and (pieces is not None or streams):  # layer_in_pieces writes the state in place: its
            state = state.with_room(self.cfg.blocks_entering(self.end))  # own copy, with room
        for layer in self.layers_range:
            if should_stop is not None and should_stop():
                raise Cancelled("the forward was cancelled")
            weights = self.spine.layer(layer)
            if capture is not None and capture.wants(layer):
                capture.take(layer, _rows_of(state, blocks), lambda rows, w=weights: layer_input(w, rows))
            self.spine.prefetch_after(layer)
            prefetch_experts(self, layer, state)
            fused = getattr(self.experts, "fused", None) if self.wide is None else None
            experts = {"fused": _timed(self.timings, fused) if fused is not None else None,
                       "routed": None if fused is not None else self._timed_routed, "router": self.router}
            if streams and layer == self.end - 1:
                state = layer_in_pieces(self.cfg, layer, weights, state, pieces_of(spans, STREAM_PIECE_TOKENS),
                                        self.experts.experts, done=done)
            elif pieces is None:
                state = decoder_layer(self.cfg, layer, weights, state, spans, self.experts.experts, **experts)
            else:
                state = layer_in_pieces(self.cfg, layer, weights, state, pieces, self.experts.experts, **experts,
                                        blocks=blocks)
            if progress is not None:
                progress(layer + 1 - self.start, self.end - self.start)
        if capture is not None and self.last and capture.wants(self.end):
            capture.take(self.end, _rows_of(state, blocks),
                         lambda rows: final_hidden(self.top, rows))  # type: ignore[arg-type]
        return state

    def _timed_routed(self, layer: int, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> Callable[[], Any]:
        """The routed experts' weighted sum (wide: through every holder; else from this stage's store), timed: what
        the stage waits for once its shared experts are done."""
        finish = self.wide(layer, z, idx, w) if self.wide is not None else (
            lambda: routed_sum(self.cfg, layer, z, idx, w, self.experts.experts))
        return lambda: self.timings.count_experts(finish)

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

    def stats(self) -> StageStats:
        """Counters: tokens, seconds, sessions, and the expert store's and spine's I/O (when they stream)."""
        stats = stage_stats(self.timings, self.spine, self.experts, self.prefixes, self.layers_range)
        return replace(stats, sessions=len(self.sessions), session_bytes=self.session_bytes(), plan=self.plan)

    def close(self) -> None:
        self.sessions.close()
        self.prefixes.close()
        self.experts.close()
        self.spine.close()
        self.files.close()
        self.top = self.spine.top = None  # device memory goes with close, not with garbage collection


def _log_plan(stage: Stage) -> None:
    """The plan's parts; with -v, the decisions behind it that set speed (stage_stats.plan_details)."""
    log.info("stage [%d, %d) on %s: %s", stage.start, stage.end, stage.device, stage.plan.describe())
    log.debug("stage [%d, %d) plan: %s", stage.start, stage.end, plan_details(stage.cfg, stage.plan, stage.options))

def _log_forward(stage: Stage, batch: list[SeqInput], seconds: float, before: tuple[float, ...]) -> None:
    """-v: one line a forward with what it read and waited for (and, wide, each holder's experts and time)."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    reads = forward_reads(io_counters(stage.spine, stage.experts), before)
    log.debug("layers %d-%d: %d sequences, %d tokens in %.3fs %s%s", stage.start, stage.end - 1, len(batch),
              sum(b.num_tokens for b in batch), seconds, reads,
              f"; wide: {stage.wide.describe_forward()}" if stage.wide is not None else "")


def _timed(timings: StageTimings, fused: FusedExperts) -> FusedExperts:
    return lambda layer, z, idx, weights: timings.count_experts(lambda: fused(layer, z, idx, weights))


def _keep_states(prefixes: PrefixStore, c: SequenceCache, item: SeqInput, out: SeqOutput,
                 tokens: array | None) -> None:
    """After a forward: the states `save_at` asks for, kept (at its end the session's own, with the last stage's
    logits; inside it those taken as it ran)."""
    for n, prefix_id in item.save_at:
        kept = c.share() if n == c.length else c.taken_at(item.cache_len, n - item.cache_len)
        if n == c.length and out.logits is not None:
            kept.logits = out.logits[-1].float().clone()
        prefixes.keep(prefix_id, kept, tokens[:n] if tokens is not None else None)
    c.clear_marks()


def _capture(stage: Stage, batch: list[SeqInput], spans: list[Span]) -> FeatureCapture | None:
    """What a forward takes for the draft features its sequences ask (None: none asks)."""
    if not any(b.features for b in batch):
        return None
    return FeatureCapture([b.features for b in batch], [(s.start, s.length, b.cache_len) for s, b in
                                                         zip(spans, batch, strict=True)], stage.start, stage.end,
                          stage.last)


def _outputs(stage: Stage, batch: list[SeqInput], spans: list[Span], state: ResidualState,
             all_logits: bool, capture: FeatureCapture | None = None,
             blocks: SpilledBlocks | None = None) -> list[SeqOutput]:
    """A forward's outputs: each sequence's residual state for the next stage (as bfloat16 with --wire bf16: what
    crosses the link), or from the last stage its logits (its last row's; every row's with `all_logits` or a
    speculative forward); with the features it asked for."""
    features = capture.taken if capture is not None else [{} for _ in batch]
    if not stage.last:
        if stage.options.wire == "bf16":
            state = ResidualState(state.P.to(torch.bfloat16), state.B.to(torch.bfloat16))
        return [SeqOutput(b.session_id, state=s, features=f) for b, s, f in
                zip(batch, state.split([s.length for s in spans]), features, strict=True)]
    if not all_logits:
        state, spans = _logit_rows(batch, spans, state, blocks)
    logits = head(stage.cfg, stage.top, state)  # type: ignore[arg-type]
    return [SeqOutput(b.session_id, logits=logits[s.start:s.start + s.length], features=f)
            for b, s, f in zip(batch, spans, features, strict=True)]


def _piece_outputs(stage: Stage, batch: list[SeqInput], spans: list[Span], piece: Piece, rows: ResidualState,
                   capture: FeatureCapture | None) -> list[SeqOutput]:
    """A piece of the last layer's outputs, final, as slices of its sequences' states (as `_outputs` sends them)."""
    which = {id(s.cache): i for i, s in enumerate(spans)}
    if stage.options.wire == "bf16":
        rows = ResidualState(rows.P.to(torch.bfloat16), rows.B.to(torch.bfloat16))
    out = []
    for part in piece.spans:
        i, cut = which[id(part.cache)], slice(part.start, part.start + part.length)
        first = int(piece.rows[part.start]) == spans[i].start  # the slice that starts a sequence carries its features
        out.append(SeqOutput(batch[i].session_id, state=ResidualState(rows.P[cut], rows.B[cut]),
                             features=capture.taken[i] if capture is not None and first else {}))
    return out


def _logit_rows(batch: list[SeqInput], spans: list[Span], state: ResidualState,
                blocks: SpilledBlocks | None = None) -> tuple[ResidualState, list[Span]]:
    """The rows the last stage returns logits for: the last token's, but every token's of a speculative sequence
    (a spilled forward's blocks read back from `blocks`)."""
    keep = [(s.start, s.length) if b.speculative else (s.start + s.length - 1, 1) for b, s in zip(batch, spans,
                                                                                               strict=True)]
    rows = torch.tensor([r for start, n in keep for r in range(start, start + n)], device=state.P.device)
    state = _rows_of(state, blocks)(rows)
    at = [0, *itertools.accumulate(n for _, n in keep)]
    return state, [Span(at[i], n, s.cache) for i, ((_, n), s) in enumerate(zip(keep, spans, strict=True))]


def _rows_of(state: ResidualState, blocks: SpilledBlocks | None) -> Callable[[torch.Tensor], ResidualState]:
    """The state of some of a forward's rows (a spilled forward's blocks read back from `blocks`)."""
    def rows_of(rows: torch.Tensor) -> ResidualState:
        at = rows.to(state.P.device)
        return ResidualState(state.P[at], state.B[at] if blocks is None else blocks.read(rows.cpu()))
    return rows_of
