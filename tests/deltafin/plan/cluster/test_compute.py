"""The plan's compute (pure): FLOP a layer's spine takes against the checkpoint's own tensor shapes, the measured
speeds' arithmetic, and a plan's predicted time with compute: the spine's compute added one layer after another,
the routed experts' overlapping their reads."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from deltafin.checkpoint.config import parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.plan.cluster.cluster_plan import WorkerCapacity
from deltafin.plan.cluster.compute import ComputeSpeed, assumed_gpu, head_flop, layer_flop, spine_seconds
from deltafin.plan.cluster.links import Links, profile
from deltafin.plan.planner import plan_layers
from deltafin.plan.timing.hops import hops_seconds
from deltafin.plan.timing.predict import (
    distinct_experts,
    forward_lengths,
    prefill_seconds,
    prompt_forward,
    token_seconds,
)

GB = 10**9
SPEED = ComputeSpeed(expert_one_s=2e-3, expert_token_s=1.5e-3, spine_one={"int8": 40e9, "q4": 50e9},
                     spine_many={"int8": 70e9, "q4": 80e9})


def _header_matrices(ckpt: Path, layer: int) -> float:
    """2 x the weights of a layer's non-expert matrices, read from the safetensors headers themselves."""
    total = 0
    for f in sorted(ckpt.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            shape = t.get("shape", []) if isinstance(t, dict) else []
            if (f"layers.{layer}." in name and ".experts." not in name and len(shape) == 2 and min(shape) > 1):
                total += shape[0] * shape[1]
    return 2.0 * total


def test_a_layer_s_flop_are_its_matrices_as_the_checkpoint_stores_them(small_dir):
    from deltafin.checkpoint.config import load_config
    cfg = load_config(small_dir)
    for layer in range(cfg.num_layers):
        assert layer_flop(cfg, layer) == _header_matrices(small_dir, layer) > 0


def test_the_speeds_arithmetic():
    # an expert: each at least its one-token time, a batch at least its tokens' share
    assert SPEED.expert_seconds(10, 10) == pytest.approx(10 * 2e-3)
    assert SPEED.expert_seconds(10, 1000) == pytest.approx(1000 * 1.5e-3)
    # a spine: at least a pass over the weights, at least the tokens at the batched rate
    assert SPEED.spine_seconds(4e9, 1, "int8") == pytest.approx(4e9 / 40e9)
    assert SPEED.spine_seconds(4e9, 100, "q4") == pytest.approx(100 * 4e9 / 80e9)
    assert SPEED.spine_seconds(4e9, 100, "bf16") == 0.0  # not measured: left out


def test_an_assumed_gpu_reads_each_weight_once_for_a_token_and_computes_a_batch_at_its_flop_rate():
    """docs/PERF.md's M1 Max (400 GB/s, 10 TFLOP/s) at K3's shapes: a decoded token's 25.8 GB of experts at memory speed
    (~65 ms), a layer's int8 spine read once, a 4K prompt's spine at 10 TFLOP/s."""
    k3 = parse_config(preset_config("k3"))
    mac = assumed_gpu(k3, 400, 10)
    token = len(k3.moe_layers) * mac.expert_seconds(16, 16)
    assert token == pytest.approx(k3.expert_bytes_per_token() / 400e9)
    flop = layer_flop(k3, 10)
    assert mac.spine_seconds(flop, 1, "int8") == pytest.approx(flop / 2 / 400e9)  # a byte a weight, 2 FLOP each
    assert mac.spine_seconds(flop, 1, "bf16") == pytest.approx(flop / 400e9)
    assert mac.spine_seconds(flop, 4096, "q4") == pytest.approx(4096 * flop / 10e12)
    # an expert's FLOP a token: 2 a weight, MXFP4's 4.25 bits a weight
    assert mac.expert_token_s == pytest.approx(2 * k3.bytes_per_expert * 8 / 4.25 / 10e12)


def test_a_stage_s_spine_runs_every_token_and_the_head_once():
    k3 = parse_config(preset_config("k3"))
    layers = sum(layer_flop(k3, i) for i in range(46, 93))
    want = 819 * layers / 70e9 + head_flop(k3) / 40e9  # the head on the last position: a one-token pass
    assert spine_seconds(k3, SPEED, 46, 93, 819, "int8") == pytest.approx(want)
    assert head_flop(k3) == 2 * 163840 * 7168


def _macs(n: int, speed: ComputeSpeed | None) -> list[WorkerCapacity]:
    return [WorkerCapacity(f"m{i}", 56 * GB, 6.6, ((0, 93),), True, address=f"m{i}:1", device="mps",
                           worker_id=f"m{i}", compute=speed) for i in range(n)]


@pytest.mark.parametrize("experts", ["local", "wide"])
def test_a_plan_adds_its_spine_s_compute_and_overlaps_the_experts_with_their_reads(experts):
    k3 = parse_config(preset_config("k3"))
    links = Links(assumed=profile(0.5, 10_000))
    blind = plan_layers(k3, _macs(2, None), experts=experts, links=links)
    timed = plan_layers(k3, _macs(2, SPEED), experts=experts, links=links)
    assert [(s.start, s.end) for s in timed.stages] == [(s.start, s.end) for s in blind.stages]
    spine = sum(spine_seconds(k3, SPEED, s.start, s.end, 1, s.plan.spine) for s in timed.stages)
    t, b = token_seconds(k3, timed), token_seconds(k3, blind)
    assert b.compute == 0 and (t.disk, t.link) == pytest.approx((b.disk, b.link))
    # a token's experts (16 a layer, 1.5-2 ms each) take less than their reads (~15 ms a layer): only the spine adds
    assert t.total == pytest.approx(b.total + spine, rel=1e-9)
    n = 4096
    p, q = prefill_seconds(k3, timed, n), prefill_seconds(k3, blind, n)
    forwards = forward_lengths(n, prompt_forward(timed))  # a prompt's forwards: the cache lent, of equal length
    spine = sum(spine_seconds(k3, SPEED, s.start, s.end, f, s.plan.spine) for s in timed.stages for f in forwards)
    experts_s = sum(SPEED.expert_seconds(distinct_experts(k3, f), f * 16) for f in forwards) * len(k3.moe_layers)
    if experts == "local":  # one stage after another, each MoE layer the longer of its reads and its compute
        assert p.compute == pytest.approx(spine + experts_s, rel=1e-6)
        # a 4K prompt's ~6M (token, expert) pairs at 1.5 ms outlast their reads: the compute sets every layer's time
        assert p.total == pytest.approx(spine + experts_s + p.link, rel=1e-6)
    else:  # every holder computes its share of each layer at once: the slowest share's time
        assert spine + experts_s / 2 <= p.compute < spine + 0.6 * experts_s
        # the compute outlasts the reads of every layer; the other holder computes once its rows have come and
        # sends its sums after, with that much fewer experts (plan/cluster/prompt_split.py): the owner's compute sets
        # each layer's time (whole experts: within one expert's time of the other holder's), and only the stages' hops
        # add
        hops = sum(hops_seconds(k3, timed, f, 4) for f in forwards)
        assert p.total == pytest.approx(p.compute + hops, rel=1e-3)
    assert p.total > q.total + spine


def test_a_worker_whose_compute_is_not_known_adds_none():
    k3 = parse_config(preset_config("k3"))
    macs = _macs(2, SPEED)
    macs[1] = replace(macs[1], compute=None)
    plan = plan_layers(k3, macs, experts="local")
    t = token_seconds(k3, plan)
    first = plan.stages[0]
    assert t.compute == pytest.approx(spine_seconds(k3, SPEED, first.start, first.end, 1, first.plan.spine)
                                      + SPEED.expert_seconds(16, 16) * (first.plan.expert_layers or 0))
