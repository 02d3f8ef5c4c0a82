"""One model of memory: what a stage of the model holds, from the config alone (pure: no I/O, no torch).

The planner (once per stage: the stage loads that plan, a worker only checks it, stage_check.py), `bench`,
`inspect` and the plan table take their numbers from here, and the stage places its tensors by the same rules
(`matrix_format`; layer_table.py's), so what is planned is what is allocated. A stage of layers [a, b) holds:

    resident layers   the first k layers' spine as placed: vectors fp32, matrices bf16 as stored (every
                      device: fp32 activations multiply bf16 weights without an fp32 copy), row-int8
                      (one byte per value + an fp16 scale per row) or q4 (4-bit groups, the sensitive matrices
                      row-int8), MLA's kv_b in the activation dtype
    streamed layers   the rest: read per pass into two host buffers (double-buffered, one layer ahead),
                      copied to the device on GPUs (two layers as placed); a bf16 spine streams the tensors as
                      stored, an int8 or q4 spine its converted files (layer_table.Streamed)
    top               the embedding (first stage, as stored) and final norms + head (last stage)
    experts           every routed expert resident, when that fits; else a cache of expert slots plus the
                      reader's working slots (three layers' worth of prefetch + one read per thread); on a
                      discrete GPU the slots read into host staging and the cache lives on the device. Wide
                      experts (`expert_layers` set): the store serves its share of every MoE layer it holds, for
                      its stage and others', as a cache (capped at those layers' experts), with a second layer of
                      demand slots and the buffers of expert calls (rows out, outputs back) for `forward_tokens`
    sessions          per-sequence caches for `sequences` sequences of `context` tokens: KDA conv window +
                      recurrent state (fp32, fixed size), MLA latents (576 values per token per layer)
    workspace         the forward's temporaries for `forward_tokens` tokens (activations, attention scores
                      in query blocks, logits, bounded weight-conversion blocks: forward_workspace.py)
    overhead          the runtime itself (interpreter, torch, kernels): host memory

Choice, when the user fixes nothing (`choose`): every expert resident if that fits beside a whole spine (bf16,
else row-int8: no disk reads at all is worth the int8 rounding); else experts stream, the spine is bf16 if it
fits whole, row-int8 if that does, else q4 (the compact one), whatever q4 does not fit streams, and the expert
cache takes what is left; the plan says why (`spine_why`). Memory is shared in time between decode and a prompt:
a stage that streams its own experts through a cache keeps one attention piece's forward beside it (decode steps,
a short prompt or a chat's next turn), and a longer prompt's forward borrows the cache (`prompt_tokens`: the
longest forward, up to the context, that fits with the cache lent; `_lending_choice`, `_lend_cache`), what it
leaves of the cache reading the next experts ahead (`kept_while_lent`). Other stages (experts resident, a wide
store serving others' calls) carry the planned context in a forward if its workspace fits FORWARD_SHARE of the
budget, else as many tokens as do, and more where a small expert cache gives way (`_grow_forward`). One worker
(sizing_options.py) plans one sequence of ONE_USER_CONTEXT tokens. If not even the working set fits, SizingError
says so with the numbers.
"""

from __future__ import annotations

from dataclasses import replace

from deltafin.checkpoint.config import ModelConfig
from deltafin.errors import SizingError
from deltafin.formats import auto_spines, spine_format, stored_spine
from deltafin.models.pieces import PIECE_TOKENS
from deltafin.plan.memory.forward_workspace import FORWARD_SHARE, auto_forward_tokens, workspace_bytes
from deltafin.plan.memory.layer_table import (
    LayerTable,
    layer_table,
    model_spines,
)
from deltafin.plan.memory.sizing_options import (
    QUALITY_SOURCE,
    Placement,
    SizingInput,
    one_user,
    one_worker,
    planned_sequences,
    resolved,
)
from deltafin.plan.memory.spill_cost import pass_bytes, spill_pays
from deltafin.plan.memory.stage_parts import (
    expert_call_bytes,
    expert_slot_bytes,
    kda_trail_bytes,
    sequence_bytes,
    top_bytes,
    working_slots,
)
from deltafin.plan.memory.stage_plan import GB, Budget, StagePlan

RUNTIME_OVERHEAD = 1 << 30  # interpreter, torch and its allocator, kernels, Python objects: measured 0.6-0.9 GB


def expert_parts(cfg: ModelConfig, place: Placement, options: SizingInput, n_moe: int, expert_cache: int | None,
                  demand: int) -> tuple[int, int, int, int]:
    """(cache, host staging, device landing, expected bytes read per token) of an expert store over `n_moe` MoE
    layers: every expert resident (`expert_cache` None), or a cache of whole slots beside the working slots of
    `demand` compute threads; a wide store computes `options.expert_share` of those layers' experts."""
    slot = expert_slot_bytes(cfg)
    if expert_cache is None:
        return n_moe * cfg.num_experts * slot, 0, 0, 0
    cache_slots = expert_cache // slot
    working = working_slots(cfg, options.read_threads * options.disks, demand) * slot if n_moe else 0
    share = options.expert_share if options.wide else 1.0
    held = min(1.0, cache_slots / (n_moe * cfg.num_experts * share)) if n_moe and share > 0 else 0.0
    per_token = round(n_moe * cfg.experts_per_token * options.expert_read_share * cfg.bytes_per_expert * share
                      * (1 - held))
    return cache_slots * slot, working, working if place.copies and place.experts != "mlx" else 0, per_token


def stream_format(spine: str, options: SizingInput) -> str:
    """What a streamed layer of a `spine` stage is read as: its converted copy's files, or (no copy: the spine as
    stored, and a converted format quantized as the resident layers load) the checkpoint's tensors as stored."""
    return spine if options.converted else stored_spine()


def size_stage(cfg: ModelConfig, start: int, end: int, place: Placement, spine: str, expert_cache: int | None,
               resident_count: int, options: SizingInput) -> StagePlan:
    """The sizing of one concrete choice: `resident_count` leading layers resident in `spine` format, experts
    resident (`expert_cache` None) or streamed with a cache of up to that many bytes."""
    options = resolved(cfg, options, one_user(cfg, start, end, options))
    t = layer_table(cfg, place, options.spans)
    if options.prefill_chunk is None:  # no budget to keep within: the whole planned context in one forward
        options = replace(options, prefill_chunk=max(1, options.context))
    ids = tuple(range(start, end))
    resident, streamed = ids[:resident_count], ids[resident_count:]
    prefix = t.resident(spine)
    own_moe = t.moe[end] - t.moe[start]
    n_moe = options.expert_layers if options.wide else own_moe
    if expert_cache is None and options.wide:
        raise SizingError("wide experts are always cached, never all resident")
    cache, staging, landing, per_token = expert_parts(cfg, place, options, n_moe, expert_cache,
                                                       2 if options.wide else 1)
    calls = expert_call_bytes(cfg, options.prefill_chunk, own_moe > 0, n_moe > 0) if options.wide else 0
    sessions, prefixes, sequences = _session_parts(cfg, t, start, end, place, options)
    last = end == cfg.num_layers
    stream = t.streamed(stream_format(spine, options))
    return StagePlan(
        start=start, end=end, device=place.device, spine=spine, resident_layers=resident, streamed_layers=streamed,
        layers=prefix[start + resident_count] - prefix[start],
        top=top_bytes(cfg, place, spine, start == 0, last),
        stream_buffers=2 * max((stream.span[i] for i in streamed), default=0),
        stream_copies=2 * max((stream.copy[i] for i in streamed), default=0),
        experts_resident=expert_cache is None, expert_cache=cache, expert_staging=staging, expert_landing=landing,
        expert_calls=calls, sessions=sessions, prefixes=prefixes,
        workspace=workspace_bytes(cfg, t, start, end, options.prefill_chunk, options.context, last),
        overhead=RUNTIME_OVERHEAD, forward_tokens=options.prefill_chunk,
        prompt_tokens=max(options.prefill_chunk, min(options.prompt_tokens or 0, options.context)),
        spill_tokens=min(options.spill_tokens or 0, options.context),
        spine_bytes_per_token=sum(stream.stored[i] for i in streamed), expert_bytes_per_token=per_token,
        discrete=place.discrete, expert_layers=n_moe, expert_share=options.expert_share if options.wide else 1.0,
        sequences=sequences, converted=options.converted or not spine_format(spine).converted, context=options.context,
        wide=options.wide, expert_read_share=options.expert_read_share)


def _session_parts(cfg: ModelConfig, t: LayerTable, start: int, end: int, place: Placement,
                   options: SizingInput) -> tuple[int, int, int]:
    """(sessions, kept prefixes, sequences planned): the planned sequences' caches at the planned context (and
    a speculative forward's trail each), a kept state each for the prefixes; the bytes as fixed where the user
    (or the coordinator's assignment) fixed them."""
    sequences = planned_sequences(cfg, start, end, options)
    n_kda, n_mla = t.kda[end] - t.kda[start], t.mla[end] - t.mla[start]
    state = sequence_bytes(cfg, n_kda, n_mla, options.context, place.act_bytes)
    trail = n_kda * kda_trail_bytes(cfg, options.speculative_tokens) if options.speculative_tokens else 0
    fixed = options.session_bytes
    sessions, kept = (fixed, fixed) if fixed is not None else (sequences * (state + trail), sequences * state)
    prefixes = options.prefix_cache_bytes if options.prefix_cache_bytes is not None else kept
    return sessions, prefixes, sequences


def choose(cfg: ModelConfig, start: int, end: int, place: Placement, budget: Budget,
           options: SizingInput) -> StagePlan:
    """The best stage that fits `budget` (see the module docstring), saying why its spine format
    (`spine_why`); SizingError when none does. With no context given, the plan is for BASE_CONTEXT (at most the
    model's own): plan/memory/context.py grows it into the room the plan leaves."""
    options = resolved(cfg, options, one_user(cfg, start, end, options))
    if options.prefill_chunk is not None:
        s = _choose(cfg, start, end, place, budget, options)
    else:
        lending = _lending_choice(cfg, start, end, place, budget, options)
        if lending is not None:
            s = lending
        else:
            s, auto = _auto_forward_choice(cfg, start, end, place, budget, options)
            s = _grow_forward(cfg, s, place, budget, auto)
    return replace(s, spine_why=_spine_why(cfg, s, place, budget, options))


def _auto_forward_choice(cfg: ModelConfig, start: int, end: int, place: Placement, budget: Budget,
                         options: SizingInput) -> tuple[StagePlan, SizingInput]:
    """The stage at the forward auto_forward_tokens gives `budget`, and the options with it; where that forward
    leaves no plan, at the shortest it gives (the one for a budget of nothing): a longer forward never makes a
    budget that holds the working set refuse, so a stage plans in every budget from the least it needs
    (plan/memory/least.py finds it) and the "at least" of the refusal is that least."""
    table = layer_table(cfg, place, options.spans)
    auto = replace(options, prefill_chunk=auto_forward_tokens(cfg, table, start, end, options.context, budget.device))
    try:
        return _choose(cfg, start, end, place, budget, auto), auto
    except SizingError:
        shortest = replace(options, prefill_chunk=auto_forward_tokens(cfg, table, start, end, options.context, 0))
        if shortest.prefill_chunk == auto.prefill_chunk:
            raise
        return _choose(cfg, start, end, place, budget, shortest), shortest


def _choose(cfg: ModelConfig, start: int, end: int, place: Placement, budget: Budget,
            options: SizingInput) -> StagePlan:
    n = end - start
    limit = n if options.max_resident_layers is None else max(0, min(n, options.max_resident_layers))
    spines = model_spines(cfg, for_room_too=options.converted) if options.spine == "auto" else (options.spine,)
    cache = options.expert_cache_bytes or 0
    if limit == n:
        if options.expert_cache_bytes is None and not options.wide:  # every expert resident, if that fits beside
            # a whole spine
            for spine in model_spines(cfg, for_room_too=False) if options.spine == "auto" else spines:
                s = size_stage(cfg, start, end, place, spine, None, n, options)
                if budget.fits(s):
                    return s
        for spine in spines:  # a whole spine, in the first format that fits
            s = size_stage(cfg, start, end, place, spine, cache, n, options)
            if budget.fits(s):
                return _fill_cache(cfg, s, place, budget, options)
    count = _most_resident(cfg, start, end, place, spines[-1], cache, options, budget, limit)
    if count is not None:  # the last format, with a streamed tail
        return _fill_cache(cfg, size_stage(cfg, start, end, place, spines[-1], cache, count, options), place, budget,
                           options)
    need = min((size_stage(cfg, start, end, place, spines[-1], cache, k, options) for k in range(limit + 1)),
               key=lambda s: s.device_total)
    host = f" and {need.host / GB:.2f} GB of host memory" if need.host else ""
    have = f" ({budget.host / GB:.2f} GB host)" if budget.host is not None else ""
    raise SizingError(
        f"layers {start}-{end - 1} cannot fit on {place.device}: streaming every expert and as much spine as "
        f"helps, they need at least {need.device_total / GB:.2f} GB{host} ({need.describe()}), and the budget is "
        f"{budget.device / GB:.2f} GB{have}. Give this stage fewer layers (more workers) or more memory, or ask "
        "for fewer or shorter sequences")


def _grow_forward(cfg: ModelConfig, s: StagePlan, place: Placement, budget: Budget,
                  options: SizingInput) -> StagePlan:
    """With no forward size fixed: a small expert cache gives way to a longer forward. A cache that holds under
    FORWARD_SHARE of the experts it serves saves decode under a tenth of its reads, while a prompt longer than
    the forward reads every expert once more per forward; so such a cache shrinks, down to nothing, for the
    longest forward up to the planned context that the budget then holds (the spine stays as planned)."""
    if s.forward_tokens >= options.context or s.experts_resident or not s.expert_cache or lends(cfg, s):
        return s  # (a stage whose prompts borrow the cache keeps it for decode: `_lend_cache`)
    served = s.expert_layers * cfg.num_experts * expert_slot_bytes(cfg) * s.expert_share
    if s.expert_cache > FORWARD_SHARE * served:
        return s

    def sized(tokens: int) -> StagePlan:
        return size_stage(cfg, s.start, s.end, place, s.spine, options.expert_cache_bytes or 0,
                          len(s.resident_layers), replace(options, prefill_chunk=tokens))

    lo, hi = s.forward_tokens, options.context  # workspace grows with tokens: the longest that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if budget.fits(sized(mid)) else (lo, mid - 1)
    if lo == s.forward_tokens:
        return s
    return _fill_cache(cfg, sized(lo), place, budget, replace(options, prefill_chunk=lo))


def _lending_choice(cfg: ModelConfig, start: int, end: int, place: Placement, budget: Budget,
                    options: SizingInput) -> StagePlan | None:
    """No forward size fixed, a stage whose prompts borrow its expert cache (`lends`): the forward beside the cache
    is one attention piece (decode steps, a short prompt or a chat's next turn), every other byte the cache's, and a
    longer prompt's forward borrows the cache (`_lend_cache`). None where the stage does not lend (its experts
    resident, wide, or a cache of every expert): its forward is sized as `_auto_forward_choice` sizes it."""
    if not cfg.moe_layers or options.wide:
        return None
    try:
        s = _choose(cfg, start, end, place, budget, replace(options, prefill_chunk=min(PIECE_TOKENS, options.context)))
    except SizingError:
        return None
    return _lend_cache(cfg, s, place, budget, options) if lends(cfg, s) else None


def lent(cfg: ModelConfig, s: StagePlan, place: Placement, options: SizingInput, tokens: int,
         spilled: bool = False) -> StagePlan:
    """`s` during a prompt's forward of `tokens` tokens with its expert cache lent: the same spine, resident layers,
    sessions and working slots, no cache slots, the workspace of that forward (`spilled`: its blocks on the SSD)."""
    fixed = replace(resolved(cfg, options), context=s.context, sequences=s.sequences or None, prefill_chunk=tokens,
                    prompt_tokens=None, spill_tokens=None, session_bytes=s.sessions, prefix_cache_bytes=s.prefixes)
    during = size_stage(cfg, s.start, s.end, place, s.spine, 0, len(s.resident_layers), fixed)
    if not spilled:
        return during
    table = layer_table(cfg, place, options.spans)
    return replace(during, workspace=workspace_bytes(cfg, table, s.start, s.end, tokens, s.context,
                                                     s.end == cfg.num_layers, spilled=True))


def kept_while_lent(cfg: ModelConfig, s: StagePlan, place: Placement, tokens: int) -> int:
    """Bytes of `s`'s expert cache a prompt's forward of `tokens` leaves it (its workspace takes the rest of the
    cache's and the plan's own workspace's): the store reads the next experts ahead into them while the layer
    before computes (runtime/read_ahead.py; plan/timing/predict.py prices it). A forward longer than `prompt_tokens`
    spills."""
    need = workspace_bytes(cfg, layer_table(cfg, place), s.start, s.end, tokens, s.context, s.end == cfg.num_layers,
                           spilled=tokens > s.prompt_tokens)
    return max(0, min(s.expert_cache, s.expert_cache + s.workspace - need))


def lends(cfg: ModelConfig, s: StagePlan) -> bool:
    """Whether a prompt may borrow `s`'s expert cache: it streams its own experts (a wide store serves others' calls
    from its cache) through a cache that holds less than every expert (a prompt reads each once anyway)."""
    every = s.expert_layers * cfg.num_experts * expert_slot_bytes(cfg)
    return s.streaming and not s.wide and 0 < s.expert_cache < every


def _lend_cache(cfg: ModelConfig, s: StagePlan, place: Placement, budget: Budget,
                options: SizingInput) -> StagePlan:
    """With no forward size fixed: a prompt longer than the forward borrows the expert cache for its forwards, so
    that one forward carries it (each forward reads every expert it touches again, while the cache holds under a
    hundredth of K3's); `prompt_tokens` is the longest forward, up to the context, whose workspace fits the
    budget with the cache at none. Decode takes the cache back (runtime/stage.py)."""
    if not lends(cfg, s) or s.forward_tokens >= s.context:
        return s
    lo, hi = s.forward_tokens, s.context  # workspace grows with tokens: the longest that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if budget.fits(lent(cfg, s, place, options, mid)) else (lo, mid - 1)
    return _spill(cfg, replace(s, prompt_tokens=lo), place, budget, options)


def _spill(cfg: ModelConfig, s: StagePlan, place: Placement, budget: Budget, options: SizingInput) -> StagePlan:
    """On a stage of every layer whose prompts borrow the cache: `spill_tokens`, the longest forward, up to the
    context, that the budget holds with its rows' blocks on the SSD and whose spill costs the disk less than one
    more forward's reads (plan/memory/spill_cost.py); none where no such forward is longer than `prompt_tokens`."""
    if not options.spill or not one_worker(cfg, s.start, s.end, options) or s.prompt_tokens >= s.context:
        return s
    again = pass_bytes(cfg, s.expert_layers, s.spine_bytes_per_token)
    lo, hi = s.prompt_tokens, s.context  # workspace and spill grow with tokens: the longest that fits and pays
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = budget.fits(lent(cfg, s, place, options, mid, spilled=True)) and spill_pays(
            cfg, s.start, s.end, mid, place.act_bytes, again)
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return replace(s, spill_tokens=lo) if lo > s.prompt_tokens else s


def _fill_cache(cfg: ModelConfig, s: StagePlan, place: Placement, budget: Budget,
                options: SizingInput) -> StagePlan:
    """The expert cache takes what the rest leaves (unless the user fixed it)."""
    if options.expert_cache_bytes is not None or not (cfg.moe_layers and (s.end > cfg.first_k_dense
                                                                            or options.wide)):
        return s
    room = budget.device - s.device_total
    cache = s.expert_cache + max(0, room)
    moe = s.expert_layers if options.wide else sum(cfg.is_moe(i) for i in range(s.start, s.end))
    cache = min(cache, moe * cfg.num_experts * expert_slot_bytes(cfg))  # never more than every expert it reads
    return size_stage(cfg, s.start, s.end, place, s.spine, cache, len(s.resident_layers), options)


def _most_resident(cfg: ModelConfig, start: int, end: int, place: Placement, spine: str, cache: int,
                   options: SizingInput, budget: Budget, limit: int) -> int | None:
    """The most leading layers that can stay resident, or None if even none can. Not a binary search: a
    layer that turns resident no longer needs a stream buffer, so memory is not monotonic in the count."""
    t = layer_table(cfg, place, options.spans)
    stream = t.streamed(stream_format(spine, options))
    base = size_stage(cfg, start, end, place, spine, cache, 0, options)  # the parts that do not depend on k
    prefix = t.resident(spine)
    fixed = base.device_total - base.stream_copies - (0 if base.discrete else base.stream_buffers)
    host_fixed = base.host - base.stream_buffers
    span = copy = 0
    suffix = []  # suffix[j]: (max span, max copy) of layers start+j .. end-1
    for i in range(end - 1, start - 1, -1):
        span, copy = max(span, stream.span[i]), max(copy, stream.copy[i])
        suffix.append((span, copy))
    suffix.reverse()
    suffix.append((0, 0))
    for k in range(limit, -1, -1):
        span, copy = suffix[k]
        device = fixed + prefix[start + k] - prefix[start] + 2 * copy + (0 if base.discrete else 2 * span)
        host = host_fixed + 2 * span
        if device <= budget.device and (budget.host is None or not base.discrete or host <= budget.host):
            return k
    return None


# ---- why this spine format -------------------------------------------------------------------------------


def _spine_why(cfg: ModelConfig, s: StagePlan, place: Placement, budget: Budget, options: SizingInput) -> str:
    """Why `s` holds its spine in its format: as asked, or (auto) what the format before it would have cost
    and what this one costs in quality (its format's `quality`, from QUALITY_SOURCE)."""
    no_copy = "" if s.converted else "; no converted copy to read: quantized as the resident layers load"
    if options.spine != "auto":
        return "as given (--spine, or the plan of the cluster this stage is part of)" + no_copy
    if s.spine == stored_spine():
        return "the whole spine fits as stored"
    order = auto_spines()
    before = order[order.index(s.spine) - 1]
    if s.experts_resident:
        lost = f"every expert fits beside an {s.spine} spine, not beside a {before} one"
    else:
        lost = _would_stream(cfg, s, place, budget, options, before)
    tail = (f"; {len(s.streamed_layers)} of {s.end - s.start} layers still stream, read as "
            f"{'converted' if s.converted else 'stored'} ({s.spine_bytes_per_token / GB:.1f} GB a token)"
            ) if s.streamed_layers else ""
    tail += no_copy
    return f"{lost}; {s.spine} costs {spine_format(s.spine).quality} {QUALITY_SOURCE}{tail}"


def _would_stream(cfg: ModelConfig, s: StagePlan, place: Placement, budget: Budget, options: SizingInput,
                  spine: str) -> str:
    """What `spine` would have streamed in `s`'s place: the most layers it keeps resident at the same forward."""
    n = s.end - s.start
    limit = n if options.max_resident_layers is None else max(0, min(n, options.max_resident_layers))
    opts = replace(options, prefill_chunk=s.forward_tokens)
    k = _most_resident(cfg, s.start, s.end, place, spine, options.expert_cache_bytes or 0, opts, budget, limit)
    if k is None:
        return f"{spine} does not fit beside the working set"
    stream = layer_table(cfg, place, options.spans).streamed(stream_format(spine, options))
    per_token = sum(stream.stored[i] for i in range(s.start + k, s.end))
    return f"{spine} would stream {n - k} of {n} layers ({per_token / GB:.1f} GB a token)"
