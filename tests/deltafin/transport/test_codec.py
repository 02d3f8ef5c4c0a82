"""Wire format: residual states of every block count round-trip exactly; malformed tensors are refused;
layer ranges; stage options and counters travel as typed messages."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from deltafin.errors import CodecError
from deltafin.models.attn_res import ResidualState
from deltafin.plan.memory.sizing import SizingInput
from deltafin.plan.memory.stage_plan import StagePlan
from deltafin.runtime.stage_io import SeqInput, SeqOutput
from deltafin.runtime.stage_options import AssignmentOptions, StageOptions
from deltafin.runtime.worker_stats import HolderStats, StageStats, WideStats
from deltafin.transport import codec, forward_parts, worker_info
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.transport.worker_info import WorkerDescription, layer_ranges
from deltafin.weights.expert_stats import DiskStats, ExpertStats


@pytest.mark.parametrize("blocks", [0, 1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_states_round_trip_exactly(blocks, dtype):
    g = torch.Generator().manual_seed(blocks)
    state = ResidualState(torch.randn(5, 64, generator=g).to(dtype), torch.randn(5, blocks, 64, generator=g).to(dtype))
    msgs = codec.encode_inputs([SeqInput("s", 3, state=state), SeqInput("t", 0, ids=torch.tensor([1, 2, 3]))])
    wire = pb.ForwardRequest(sequences=msgs).SerializeToString()
    back = codec.decode_inputs(list(pb.ForwardRequest.FromString(wire).sequences))
    assert torch.equal(back[0].state.P, state.P) and torch.equal(back[0].state.B, state.B)
    assert back[0].state.B.dtype == dtype and back[0].cache_len == 3
    assert torch.equal(back[1].ids, torch.tensor([1, 2, 3]))
    # size per token on the wire: (1 + n) * D * dtype size, plus a few bytes of framing
    per_token = ResidualState.nbytes_per_token(blocks, 64, state.P.element_size())
    assert len(msgs[0].p.data) + len(msgs[0].b.data) == 5 * per_token
    out = codec.decode_outputs(codec.encode_outputs([SeqOutput("s", logits=torch.randn(2, 10))]))
    assert out[0].logits.shape == (2, 10)


BAD = [
    ("unknown dtype", pb.Tensor(dtype="float64", shape=[1, 64], data=b"\0" * 512), "unknown dtype"),
    ("short data", pb.Tensor(dtype="float32", shape=[2, 64], data=b"\0" * 100), "bytes of data"),
    ("absurd shape", pb.Tensor(dtype="float32", shape=[1 << 40, 1 << 20], data=b""), "absurd"),
    ("negative dim", pb.Tensor(dtype="float32", shape=[-1, 64], data=b""), "invalid shape"),
    ("rank 9", pb.Tensor(dtype="float32", shape=[1] * 9, data=b"\0" * 4), "invalid shape"),
]


@pytest.mark.parametrize("name, tensor, message", BAD, ids=[b[0] for b in BAD])
def test_codec_rejects_malformed_tensors(name, tensor, message):
    with pytest.raises(CodecError, match=message):
        codec.decode_tensor(tensor, "t")


def test_layer_ranges():
    assert layer_ranges([0, 1, 2, 5, 6, 9]) == ((0, 3), (5, 7), (9, 10))
    d = WorkerDescription("w", "", "cpu", 1, 1.0, "fp", ((0, 3), (5, 7)), True)
    assert d.has_layers(0, 3) and d.has_layers(5, 7) and not d.has_layers(2, 6)


def test_stage_options_and_counters_travel_as_typed_messages(tiny_dir: Path) -> None:
    import torch

    from deltafin.runtime.pipeline import LocalPipeline

    defaults = StageOptions(memory_bytes=7 << 30, cache_policy="lru",
                            sizing=SizingInput(expert_cache_bytes=5_000_000, read_threads=4))
    sent = AssignmentOptions(dtype="bf16", prefetch=False, io="buffered", wire="bf16")
    got = codec.decode_stage_options(pb.StageOptions.FromString(codec.encode_stage_options(sent)
                                                                .SerializeToString()), defaults)
    assert (got.torch_dtype, got.prefetch, got.io, got.wire) == (torch.bfloat16, False, "buffered", "bf16")
    # unset: the worker's own; what a stage holds is never an option on the wire
    assert (got.memory_bytes, got.cache_policy, got.sizing.read_threads, got.sizing.expert_cache_bytes) == (
        7 << 30, "lru", 4, 5_000_000)
    with pytest.raises(CodecError, match="read_threads"):
        codec.encode_stage_options(AssignmentOptions(read_threads="many"))  # type: ignore[arg-type]
    # the wire's options are AssignmentOptions', field for field: a budget or a spine is never one
    assert {f.name for f in pb.StageOptions.DESCRIPTOR.fields} == set(AssignmentOptions().__dataclass_fields__)
    pipe = LocalPipeline.load(tiny_dir, 1, "cpu", "fp32",
                              options=StageOptions(sizing=SizingInput(expert_cache_bytes=200_000)))
    try:
        from deltafin.runtime.stage_io import SeqInput

        pipe.forward([SeqInput("s", 0, ids=torch.tensor([1, 2, 3]))])
        stage = pipe.stages[0]
        wide = WideStats("2/4x6", 10, 20, 3, 1, 4, 2, 5, 7, 0.25, peer_wait_s=0.5,
                         holders=(HolderStats("w0", 1, 2, 3, 0.125), HolderStats("w1", 4, 5, 6, 1.5)))
        stats = dataclasses.replace(stage.stats(), name="w0", rss_peak_bytes=1 << 30, handed_on=2, wide=wide)
        assert stats.sessions == 1 and stats.layers == (0, 6) and stats.plan == stage.plan
        assert stats.experts is not None and stats.experts.lookups > 0 and stats.tokens == 3
        back = codec.decode_stats(pb.StageStats.FromString(codec.encode_stats(stats).SerializeToString()))
        assert back == stats  # every counter, section and plan field, typed as sent
        assert back.plan is not None and back.plan.total == stage.plan.total
        # a worker with nothing loaded: its sections absent, not empty
        idle = codec.decode_stats(codec.encode_stats(StageStats(state="idle", name="w1")))
        assert idle == StageStats(state="idle", name="w1") and idle.experts is None and not idle.ready
    finally:
        pipe.close()


def test_the_stats_type_is_the_messages_field_for_field():
    """StageStats and its sections name exactly the fields of their messages (the experts' hit rate and prefetch
    recall are the counts' own properties; the plan's totals its sums)."""
    for cls, msg, derived in [(StageStats, pb.StageStats, ()), (WideStats, pb.WideStats, ()),
                              (HolderStats, pb.HolderStats, ()), (DiskStats, pb.DiskStats, ()),
                              (ExpertStats, pb.ExpertStats, ("hit_rate", "prefetch_recall")),
                              (StagePlan, pb.StagePlan, ("total", "host", "device_total"))]:
        fields = {f.name for f in dataclasses.fields(cls)} - {"by_layer"}
        assert fields == {f.name for f in msg.DESCRIPTOR.fields} - set(derived), cls.__name__


def test_expert_calls_and_plans_round_trip():
    from deltafin.plan.cluster.expert_placement import ExpertPlacement, ExpertRanges, Holder, HolderLink
    from deltafin.plan.cluster.links import Link
    from deltafin.runtime.wide import ExpertCall

    g = torch.Generator().manual_seed(0)
    call = ExpertCall(3, torch.randn(4, 16, generator=g), torch.tensor([0, 1, 1, 3]), torch.tensor([7, 2, 9, 2]),
                      torch.tensor([0.5, 0.25, 0.75, 1.0]), ((4, (1, 5)), (5, (0,))))
    wire = codec.encode_expert_call(call).SerializeToString()
    back, hints = codec.decode_expert_call(pb.ExpertRequest.FromString(wire))
    assert back is not None and back.layer == 3 and hints == call.hints
    assert all(torch.equal(getattr(back, f), getattr(call, f)) for f in ("z", "rows", "experts", "weights"))
    only, hints = codec.decode_expert_call(codec.encode_expert_call(None, ((2, (8, 1)),)))
    assert only is None and hints == ((2, (8, 1)),)
    ahead = codec.encode_expert_call(None, ((2, (8, 1)),), ahead=True)  # a prompt's: read as far ahead as can be
    assert pb.ExpertRequest.FromString(ahead.SerializeToString()).hints_ahead
    assert not pb.ExpertRequest.FromString(wire).hints_ahead
    with pytest.raises(CodecError, match="int64"):
        codec.decode_expert_call(codec.encode_expert_call(ExpertCall(3, call.z, call.rows.int(), call.experts,
                                                                     call.weights)))
    unweighted = codec.encode_expert_call(call)
    unweighted.ClearField("weights")
    with pytest.raises(CodecError, match="weights"):
        codec.decode_expert_call(unweighted)

    placement = ExpertRanges.build(["a", "b"], [1, 2], 16, lambda i, layer: 1.0 + i)
    plan = ExpertPlacement(placement, (Holder("a", "h:1", "mac1"), Holder("b", "h:2", "mac2")), 1.0, 5.0, 60.0)
    assert codec.decode_expert_placement(codec.encode_expert_placement(plan), 16) == plan
    linked = ExpertPlacement(placement, (Holder("a", "h:1", "mac1", 6.6, 0.002, 0.0004),
                                         Holder("b", "h:2", "mac2", 3.3)),
                        1.0, 5.0, 60.0, (HolderLink("a", "b", Link(0.004, 5e7, 2.5e7)),))
    back_plan = codec.decode_expert_placement(codec.encode_expert_placement(linked), 16)
    assert back_plan == linked and back_plan.link("b", "a") == Link(0.004, 2.5e7, 5e7)  # seen from b's side
    assert back_plan.prompt_split("a", 4, 1000, 64) is not None and plan.prompt_split("a", 4, 1000, 64) is None
    for field, value, match in (("links", "x", "a link between holders"), ("speed", math.nan, "a holder's speed")):
        broken = codec.encode_expert_placement(linked)
        if field == "links":
            broken.links[0].b = value
        else:
            broken.holders[1].expert_gbps = value
        with pytest.raises(CodecError, match=match):
            codec.decode_expert_placement(broken, 16)
    with pytest.raises(CodecError, match="the model has 32"):
        codec.decode_expert_placement(codec.encode_expert_placement(plan), 32)
    bad = codec.encode_expert_placement(plan)
    bad.layers[0].bounds[1] = 99
    with pytest.raises(CodecError, match="malformed expert plan"):
        codec.decode_expert_placement(bad, 16)


def test_a_forward_larger_than_a_message_goes_in_parts():
    """Every part stays under the size asked for (a token at least), each session's slices rejoin in order with
    its fields, and outputs likewise."""
    g = torch.Generator().manual_seed(1)
    batch = [SeqInput("step", 7, state=ResidualState(torch.randn(1, 64, generator=g), torch.randn(1, 2, 64,
                                                                                                  generator=g))),
             SeqInput("prompt", 0, state=ResidualState(torch.randn(300, 64, generator=g),
                                                       torch.randn(300, 2, 64, generator=g)),
                      save_at=((300, "kept"), (120, "mid"))),
             SeqInput("ids", 0, ids=torch.arange(50))]
    assert forward_parts.request_bytes(batch) == 301 * 3 * 64 * 4 + 50 * 8
    parts = forward_parts.encode_request_parts(batch, True, "r", 10_000)
    assert len(parts) > 20 and all(sum(len(t.data) for q in p.sequences for t in (q.ids, q.p, q.b)) <= 10_000
                                   for p in parts)
    wire = [pb.ForwardRequest.FromString(p.SerializeToString()) for p in parts]
    back, all_logits, rid = forward_parts.decode_request_parts(wire)
    assert (all_logits, rid) == (True, "r") and [b.session_id for b in back] == ["step", "prompt", "ids"]
    for a, b in zip(batch, back, strict=True):
        assert (a.cache_len, a.save_at) == (b.cache_len, b.save_at)
        assert torch.equal(a.ids, b.ids) if a.ids is not None else (torch.equal(a.state.P, b.state.P)
                                                                   and torch.equal(a.state.B, b.state.B))
    outputs = [SeqOutput("x", logits=torch.randn(1, 3000, generator=g)),
               SeqOutput("y", state=ResidualState(torch.randn(200, 64, generator=g), torch.randn(200, 3, 64,
                                                                                               generator=g)))]
    again = forward_parts.decode_output_parts(forward_parts.encode_output_parts(outputs, 20_000))
    assert torch.equal(again[0].logits, outputs[0].logits) and torch.equal(again[1].state.B, outputs[1].state.B)
    mixed = forward_parts.encode_request_parts([batch[2]], False, "r", 100) + forward_parts.encode_request_parts(
        [dataclasses.replace(batch[1], session_id="ids")], False, "r", 10_000)
    with pytest.raises(CodecError, match="do not join"):
        forward_parts.decode_request_parts(mixed)


def test_a_stage_plan_travels_whole_and_checked() -> None:
    """Every field of a plan (a wide stage's, with a streamed tail and a why) comes back equal; a plan missing a
    field, for layers the model does not have, with its layers out of order, or with a negative part is refused
    by name."""
    from deltafin.checkpoint.config import parse_config
    from deltafin.checkpoint.presets import preset_config
    from deltafin.plan.memory.sizing import Placement, choose
    from deltafin.plan.memory.stage_plan import Budget

    cfg = parse_config(preset_config("small"))
    z = choose(cfg, 1, cfg.num_layers, Placement("cuda", 2), Budget(int(0.3 * GB_), int(2 * GB_)),
               SizingInput(spine="q4", expert_layers=len(cfg.moe_layers), expert_share=0.4, max_resident_layers=2))
    assert z.wide and z.streamed_layers and z.spine_why and z.discrete
    wire = pb.StagePlan.FromString(codec.encode_stage_plan(z).SerializeToString())
    assert codec.decode_stage_plan(wire, cfg.num_layers) == z
    k3 = parse_config(preset_config("k3"))  # one Mac's at 64K: its prompts lend the cache and spill past that
    mac = choose(k3, 0, k3.num_layers, Placement("mps"), Budget(56 * GB_), SizingInput(context=65536))
    assert mac.spill_tokens > mac.prompt_tokens > mac.forward_tokens
    sent = pb.StagePlan.FromString(codec.encode_stage_plan(mac).SerializeToString())
    assert codec.decode_stage_plan(sent, k3.num_layers) == mac
    for change, words in [({"end": cfg.num_layers + 1}, "invalid layer range"), ({"expert_calls": -5}, "expert_calls"),
                          ({"resident_layers": [2, 1]}, "in order"), ({"spine": "fp4"}, "unknown spine")]:
        bad = pb.StagePlan()
        bad.CopyFrom(wire)
        for name, value in change.items():
            if isinstance(value, list):
                del getattr(bad, name)[:]
                getattr(bad, name).extend(value)
            else:
                setattr(bad, name, value)
        with pytest.raises(CodecError, match=words):
            codec.decode_stage_plan(bad, cfg.num_layers)
    partial = pb.StagePlan()
    partial.CopyFrom(wire)
    partial.ClearField("workspace")
    with pytest.raises(CodecError, match="missing workspace"):
        codec.decode_stage_plan(partial, cfg.num_layers)


GB_ = 10**9


def test_a_worker_says_its_own_spine_and_the_converted_copies_on_its_disk():
    from deltafin.plan.memory.spine_copies import SpineDisk

    disk = SpineDisk({"q4": frozenset({"layer-000", "layer-001", "embed"}), "int8": frozenset()}, room=12 * 10**9)
    d = WorkerDescription("w", "", "cpu", 1, 1.0, "fp", ((0, 2),), True, spine="q4", spine_disk=disk)
    back = worker_info.decode_info(pb.WorkerInfo.FromString(worker_info.encode_info(d).SerializeToString()), "h:1")
    assert back.spine == "q4" and back.spine_disk == disk
    unknown = dataclasses.replace(d, spine="auto", spine_disk=SpineDisk({}, None))  # room not known: unset
    wire = worker_info.encode_info(unknown).SerializeToString()
    back = worker_info.decode_info(pb.WorkerInfo.FromString(wire), "h:1")
    assert back.spine == "auto" and back.spine_disk.room is None and back.spine_disk.ready(None, "q4", 0, 2)
