"""Tensors and stage messages <-> protobuf, with every size checked before anything is built.

The one place where proto messages become typed objects (SeqInput, SeqOutput, plans, counters) and back; a
worker's description is worker_info.py's.
Anything malformed raises CodecError, which the servicer turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import torch

from deltafin.errors import CodecError, DeltafinError
from deltafin.formats import spine_formats
from deltafin.models.attn_res import ResidualState
from deltafin.plan.cluster.expert_placement import ExpertPlacement, ExpertRanges, Holder, HolderLink
from deltafin.plan.cluster.links import Link
from deltafin.plan.memory.stage_plan import StagePlan
from deltafin.runtime.features import FeatureAsk, Features
from deltafin.runtime.prefix_store import HeldPrefixes
from deltafin.runtime.stage_io import SeqInput, SeqOutput
from deltafin.runtime.stage_options import AssignmentOptions, StageOptions
from deltafin.runtime.wide import ExpertCall
from deltafin.runtime.worker_stats import HolderStats, StageStats, WideStats
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.weights.expert_stats import DiskStats, ExpertStats

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64,
          "int32": torch.int32}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_RANK = 4
MAX_ELEMENTS = 1 << 31  # no message may claim more than 2G elements, whatever its byte count

if sys.byteorder != "little":  # pragma: no cover - every supported machine is little-endian
    raise ImportError("the Deltafin wire format is little-endian")


def encode_tensor(t: torch.Tensor) -> pb.Tensor:
    if t.dtype not in NAMES:
        raise CodecError(f"cannot send dtype {t.dtype}")
    t = t.detach().contiguous().cpu()
    raw = t.view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
    return pb.Tensor(dtype=NAMES[t.dtype], shape=list(t.shape), data=raw.numpy().tobytes())


def decode_tensor(msg: pb.Tensor, what: str) -> torch.Tensor:
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise CodecError(f"{what}: unknown dtype {msg.dtype!r} (expected one of {', '.join(DTYPES)})")
    shape = list(msg.shape)
    if len(shape) > MAX_RANK or any(d < 0 for d in shape):
        raise CodecError(f"{what}: invalid shape {shape}")
    numel = math.prod(shape)
    if numel > MAX_ELEMENTS:
        raise CodecError(f"{what}: shape {shape} is absurd ({numel} elements)")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if len(msg.data) != numel * itemsize:
        raise CodecError(f"{what}: {len(msg.data)} bytes of data for {msg.dtype}{shape} "
                         f"(needs {numel * itemsize})")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(dtype).view(shape)


def encode_inputs(batch: list[SeqInput]) -> list[pb.SequenceInput]:
    out = []
    for item in batch:
        msg = pb.SequenceInput(session_id=item.session_id, cache_len=item.cache_len,
                               resume_from=item.resume_from or "", speculative=item.speculative,
                               save_at=[pb.KeepPoint(tokens=n, prefix_id=pid) for n, pid in item.save_at])
        if item.features is not None:
            msg.feature_layers.extend(item.features.layers)
            msg.features_from = item.features.start
        if item.ids is not None:
            msg.ids.CopyFrom(encode_tensor(item.ids))
        if item.state is not None:
            msg.p.CopyFrom(encode_tensor(item.state.P))
            msg.b.CopyFrom(encode_tensor(item.state.B))
        out.append(msg)
    return out


def decode_inputs(msgs: list[pb.SequenceInput]) -> list[SeqInput]:
    out = []
    for i, msg in enumerate(msgs):
        what = f"sequence {i} ({msg.session_id!r})"
        if not msg.session_id:
            raise CodecError(f"sequence {i}: empty session id")
        if msg.cache_len < 0:
            raise CodecError(f"{what}: negative cache_len")
        has_ids, has_state = msg.HasField("ids"), msg.HasField("p") or msg.HasField("b")
        if has_ids == has_state:
            raise CodecError(f"{what}: exactly one of ids or (p, b) is required")
        extra = {"resume_from": msg.resume_from or None, "speculative": msg.speculative,
                 "save_at": tuple((k.tokens, k.prefix_id) for k in msg.save_at),
                 "features": FeatureAsk(tuple(msg.feature_layers), msg.features_from) if msg.feature_layers
                 else None}
        if msg.resume_from and msg.cache_len == 0:
            raise CodecError(f"{what}: resume_from needs the prefix's length as cache_len")
        if has_ids:
            ids = decode_tensor(msg.ids, f"{what} ids")
            if ids.dim() != 1:
                raise CodecError(f"{what}: ids must be a 1-D tensor of token ids; got shape {list(ids.shape)}")
            out.append(SeqInput(msg.session_id, msg.cache_len, ids=ids, **extra))
        else:
            state = ResidualState(decode_tensor(msg.p, f"{what} p"), decode_tensor(msg.b, f"{what} b"))
            if state.P.dim() != 2 or state.B.dim() != 3 or state.P.shape[0] != state.B.shape[0]:
                raise CodecError(f"{what}: a residual state is P [T, D] and B [T, N, D]; got P "
                                 f"{list(state.P.shape)}, B {list(state.B.shape)}")
            out.append(SeqInput(msg.session_id, msg.cache_len, state=state, **extra))
    return out


def encode_held(held: HeldPrefixes) -> pb.HeldPrefixesResponse:
    msg = pb.HeldPrefixesResponse(prefix_ids=list(held.lengths), lengths=list(held.lengths.values()))
    if held.logits is not None:
        msg.logits.CopyFrom(encode_tensor(held.logits))
    return msg


def decode_held(msg: pb.HeldPrefixesResponse) -> HeldPrefixes:
    if len(msg.prefix_ids) != len(msg.lengths) or any(n < 1 for n in msg.lengths):
        raise CodecError("HeldPrefixes: one positive length per prefix id")
    logits = decode_tensor(msg.logits, "held prefix logits") if msg.HasField("logits") else None
    if logits is not None and (logits.dim() != 1 or logits.dtype != torch.float32):
        raise CodecError("HeldPrefixes: logits are a 1-D float32 tensor")
    return HeldPrefixes(dict(zip(msg.prefix_ids, msg.lengths, strict=True)), logits)


def encode_outputs(outputs: list[SeqOutput]) -> list[pb.SequenceOutput]:
    out = []
    for o in outputs:
        msg = pb.SequenceOutput(session_id=o.session_id)
        if o.state is not None:
            msg.p.CopyFrom(encode_tensor(o.state.P))
            msg.b.CopyFrom(encode_tensor(o.state.B))
        if o.logits is not None:
            msg.logits.CopyFrom(encode_tensor(o.logits))
        msg.features.extend(pb.LayerFeatures(layer=layer, rows=encode_tensor(rows)) for layer, rows in
                            o.features.items())
        out.append(msg)
    return out


def decode_outputs(msgs: list[pb.SequenceOutput]) -> list[SeqOutput]:
    out = []
    for msg in msgs:
        what = f"output {msg.session_id!r}"
        features = decode_features(msg, what)
        if msg.HasField("logits"):
            out.append(SeqOutput(msg.session_id, logits=decode_tensor(msg.logits, f"{what} logits"),
                                 features=features))
        else:
            state = ResidualState(decode_tensor(msg.p, f"{what} p"), decode_tensor(msg.b, f"{what} b"))
            out.append(SeqOutput(msg.session_id, state=state, features=features))
    return out


def decode_features(msg: pb.SequenceOutput, what: str) -> Features:
    features: Features = {}
    for f in msg.features:
        rows = decode_tensor(f.rows, f"{what} layer {f.layer} features")
        if rows.dim() != 2 or rows.dtype != torch.float32 or f.layer in features:
            raise CodecError(f"{what}: layer {f.layer}'s features must be one float32 [rows, D] tensor")
        features[f.layer] = rows
    return features


# ---- wide experts ---------------------------------------------------------------------------------------------


Hints = tuple[tuple[int, tuple[int, ...]], ...]


def encode_expert_call(call: ExpertCall | None, hints: Hints = (), ahead: bool = False) -> pb.ExpertRequest:
    """An expert call, or (None) only hints for the holder to read ahead (`ahead`: a prompt's, as far as it can)."""
    msg = pb.ExpertRequest(hints=[pb.ExpertHint(layer=layer, experts=list(ids)) for layer, ids in
                                  (call.hints if call is not None else hints)], hints_ahead=ahead)
    if call is not None:
        msg.layer = call.layer
        msg.z.CopyFrom(encode_tensor(call.z))
        msg.rows.CopyFrom(encode_tensor(call.rows))
        msg.experts.CopyFrom(encode_tensor(call.experts))
        msg.weights.CopyFrom(encode_tensor(call.weights))
        msg.bf16 = call.bf16
    return msg


def decode_expert_call(msg: pb.ExpertRequest) -> tuple[ExpertCall | None, Hints]:
    """(the call, or None when the message only hints; its hints; a prompt's hints say so: `msg.hints_ahead`)."""
    hints = tuple((h.layer, tuple(h.experts)) for h in msg.hints)
    if not msg.HasField("z"):
        if msg.HasField("rows") or msg.HasField("experts") or msg.HasField("weights"):
            raise CodecError("an expert call needs its rows z with rows, experts and weights")
        return None, hints
    if not msg.HasField("weights"):
        raise CodecError("an expert call needs its pairs' weights")
    z = decode_tensor(msg.z, "expert call z")
    rows, experts = decode_tensor(msg.rows, "expert call rows"), decode_tensor(msg.experts, "expert call experts")
    weights = decode_tensor(msg.weights, "expert call weights")
    if rows.dtype != torch.int64 or experts.dtype != torch.int64:
        raise CodecError("an expert call's rows and experts must be int64")
    return ExpertCall(msg.layer, z, rows, experts, weights, hints, msg.bf16), hints


def encode_expert_placement(plan: ExpertPlacement) -> pb.ExpertPlacement:
    p = plan.ranges
    return pb.ExpertPlacement(holders=[pb.Holder(worker_id=h.key, address=h.address, name=h.name,
                                            expert_gbps=h.expert_gbps, expert_one_s=h.expert_one_s,
                                            expert_token_s=h.expert_token_s) for h in plan.holders],
                         layers=[pb.LayerExperts(layer=layer, bounds=list(b)) for layer, b in zip(p.layers, p.bounds,
                                                                                                  strict=True)],
                         probe_interval=plan.probe_interval, lost_after=plan.lost_after,
                         call_timeout=plan.call_timeout,
                         links=[pb.HolderLink(a=x.a, b=x.b, rtt_s=x.link.rtt_s, up_bps=x.link.up_bps,
                                              down_bps=x.link.down_bps) for x in plan.links])


def decode_expert_placement(msg: pb.ExpertPlacement, num_experts: int) -> ExpertPlacement:
    holders = tuple(Holder(h.worker_id, h.address, h.name, h.expert_gbps, h.expert_one_s, h.expert_token_s)
                    for h in msg.holders)
    keys = {h.key for h in holders}
    figures = [(v, "a holder's speed") for x in msg.holders for v in (x.expert_gbps, x.expert_one_s,
                                                                      x.expert_token_s)] + \
        [(v, "a link's figures") for x in msg.links for v in (x.rtt_s, x.up_bps, x.down_bps)]
    bad = next((what for v, what in figures if not (math.isfinite(v) and v >= 0)), None)
    if bad is not None or any(x.a not in keys or x.b not in keys or x.a == x.b for x in msg.links):
        raise CodecError(f"malformed expert plan: {bad or 'a link between holders it does not have'}")
    links = tuple(HolderLink(x.a, x.b, Link(x.rtt_s, x.up_bps, x.down_bps)) for x in msg.links)
    try:
        placement = ExpertRanges(tuple(h.key for h in holders), tuple(x.layer for x in msg.layers),
                                    tuple(tuple(x.bounds) for x in msg.layers))
        if placement.layers and placement.num_experts != num_experts:
            raise ValueError(f"it places {placement.num_experts} experts a layer, the model has {num_experts}")
        return ExpertPlacement(placement, holders, msg.probe_interval or 2.0, msg.lost_after or 10.0,
                          msg.call_timeout or 600.0, links)
    except ValueError as e:
        raise CodecError(f"malformed expert plan: {e}") from None


# ---- stage options and counters ------------------------------------------------------------------------------



def encode_stage_options(options: AssignmentOptions) -> pb.StageOptions:
    """How a coordinator asks a stage to compute and read (its fields unset where the worker's own hold; dtype as
    "fp32"/"bf16"). What the stage holds is its plan (`encode_stage_plan`), never an option."""
    msg = pb.StageOptions()
    for key, value in options.given().items():
        try:
            setattr(msg, key, value)
        except (TypeError, ValueError) as e:
            raise CodecError(f"stage option {key}={value!r}: {e}") from None
    return msg


def decode_stage_options(msg: pb.StageOptions, defaults: StageOptions) -> StageOptions:
    """The options a coordinator sent, over this worker's `defaults`, checked as the command line's are (the same
    typed values): what the flags refuse, the wire cannot say either (CodecError: INVALID_ARGUMENT)."""
    changes: dict[str, Any] = {f.name: value for f, value in msg.ListFields()}
    try:
        return defaults.replace(**changes)
    except (DeltafinError, TypeError, ValueError) as e:
        raise CodecError(f"stage options: {e}") from None


_PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(StagePlan))
_PLAN_TEXT = ("device", "spine", "spine_why")
_PLAN_FLAGS = ("experts_resident", "discrete", "converted", "wide")
HOLDER_SPINE = "none"  # an expert holder's plan: no spine
_PLAN_DEVICES = ("cpu", "cuda", "mps", "meta")


def encode_stage_plan(plan: StagePlan) -> pb.StagePlan:
    """A stage's plan as the Assignment carries it (every field; its totals are left out: the worker sums them)."""
    msg = pb.StagePlan()
    _fill(msg, {name: getattr(plan, name) for name in _PLAN_FIELDS}, "plan")
    return msg


def decode_stage_plan(msg: pb.StagePlan, num_layers: int) -> StagePlan:
    """The plan a coordinator sent, with every field present and in range for a `num_layers`-layer model (what it
    costs and whether it fits is the worker's check: plan/memory/stage_check.py)."""
    got = {f.name for f, _ in msg.ListFields()}
    missing = [n for n in _PLAN_FIELDS if n not in got and n not in ("resident_layers", "streamed_layers")
               and n not in _PLAN_FLAGS and n != "spine_why"]
    if missing:
        raise CodecError(f"plan: missing {', '.join(missing)}")
    plan = _plan(msg)
    start, end = plan.start, plan.end
    if not 0 <= start <= end <= num_layers:
        raise CodecError(f"plan: invalid layer range [{start}, {end}) for a {num_layers}-layer model")
    if plan.resident_layers + plan.streamed_layers != tuple(range(start, end)):
        raise CodecError(f"plan: resident and streamed layers must be layers {start}-{end - 1}, in order")
    spines = {f.name for f in spine_formats()} | {HOLDER_SPINE}  # the registered formats (deltafin/formats)
    if plan.spine not in spines or plan.device not in _PLAN_DEVICES:
        raise CodecError(f"plan: unknown spine {plan.spine!r} or device {plan.device!r}")
    negative = [n for n in _PLAN_FIELDS if isinstance(v := getattr(plan, n), (int, float))
                and not isinstance(v, bool) and v < 0]
    if negative or not 0.0 <= plan.expert_share <= 1.0:
        raise CodecError(f"plan: {', '.join(negative) or 'expert_share'} out of range")
    return plan


def _plan(msg: pb.StagePlan) -> StagePlan:
    """The message's fields as a StagePlan, those not set empty (its totals are the plan's own sums)."""
    got = {f.name: v for f, v in msg.ListFields()}
    values: dict[str, Any] = {n: got.get(n, "" if n in _PLAN_TEXT else False if n in _PLAN_FLAGS else 0)
                              for n in _PLAN_FIELDS}
    values["resident_layers"], values["streamed_layers"] = (tuple(msg.resident_layers), tuple(msg.streamed_layers))
    return StagePlan(**values)


def encode_stats(stats: StageStats) -> pb.StageStats:
    """A worker's counters (its stage's, and what the servicer adds) as the typed message."""
    msg = pb.StageStats()
    _fill(msg, stats.as_dict(), "stats")
    return msg


def decode_stats(msg: pb.StageStats) -> StageStats:
    """The counters a worker sent: its fields as set (those not set zero, its sections None)."""
    values: dict[str, Any] = {f.name: v for f, v in msg.ListFields() if f.message_type is None and not f.is_repeated}
    experts = _set_fields(msg.experts, "hit_rate", "prefetch_recall") if msg.HasField("experts") else None
    wide = None
    if msg.HasField("wide"):
        holders = tuple(HolderStats(**_set_fields(h)) for h in msg.wide.holders)
        wide = WideStats(**_set_fields(msg.wide), holders=holders)
    return StageStats(**values, layers=(*msg.layers,) if len(msg.layers) == 2 else (0, 0),
                      experts=ExpertStats(**experts) if experts is not None else None,
                      disks=tuple(DiskStats(**_set_fields(d)) for d in msg.disks),
                      wide=wide, plan=_plan(msg.plan) if msg.HasField("plan") else None)


def _set_fields(msg: Any, *derived: str) -> dict[str, Any]:
    """A message's scalar fields that were set, less `derived` ones (computed again by the type that reads it)."""
    return {f.name: v for f, v in msg.ListFields() if f.message_type is None and not f.is_repeated
            and f.name not in derived}


def _fill(msg: Any, values: dict[str, Any], what: str) -> None:
    for key, value in values.items():
        field = msg.DESCRIPTOR.fields_by_name.get(key)
        if field is None:
            raise CodecError(f"{what}: no field {key!r} in {msg.DESCRIPTOR.name}")
        if value is None:
            continue
        if field.message_type is not None and field.is_repeated:
            for i, item in enumerate(value):
                _fill(getattr(msg, key).add(), item, f"{what}.{key}[{i}]")
        elif field.message_type is not None:
            _fill(getattr(msg, key), value, f"{what}.{key}")
        elif field.is_repeated:
            getattr(msg, key).extend(value)
        else:
            setattr(msg, key, value)
