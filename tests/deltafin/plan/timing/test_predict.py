"""A plan's predicted time on K3's full geometry (pure): a decoded token's and a prompt's link time against the
bytes counted from the config by hand (the rows of the tokens each holder gets, each way, a round trip per MoE
layer; each stage's hop through the coordinator), and the disks' time unchanged by the links."""

from __future__ import annotations

import dataclasses

import pytest

from deltafin.checkpoint.config import parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.plan.cluster.cluster_plan import WorkerCapacity
from deltafin.plan.cluster.links import Links, profile
from deltafin.plan.memory.sizing import SizingInput
from deltafin.plan.planner import plan_layers
from deltafin.plan.timing.hops import hops_seconds
from deltafin.plan.timing.predict import (
    _forward,
    _stage_busy,
    _wide_layers,
    forward_lengths,
    prefill_seconds,
    prompt_forward,
    token_seconds,
)

GB = 10**9


@pytest.fixture(scope="module")
def k3():
    return parse_config(preset_config("k3"))


def _macs(n: int) -> list[WorkerCapacity]:
    return [WorkerCapacity(f"m{i}", 56 * GB, 6.6, ((0, 93),), True, address=f"m{i}:1", device="mps",
                           worker_id=f"m{i}") for i in range(n)]


@pytest.mark.parametrize("wire", [4, 2], ids=["fp32", "bf16"])
def test_a_wide_token_pays_a_round_trip_and_a_row_each_way_per_moe_layer(k3, wire):
    """With `--wire bf16` (value_bytes 2) the states and rows cross at half the bytes; ids and logits do not change."""
    link = profile(4.0, 400)  # Wi-Fi: 4 ms, 50 MB/s each way
    plan = plan_layers(k3, _macs(2), experts="wide", links=Links(assumed=link, value_bytes=wire))
    fast = plan_layers(k3, _macs(2), experts="wide", links=Links(assumed=profile(0.0, 10**9)))
    t = token_seconds(k3, plan)
    assert t.disk == pytest.approx(token_seconds(k3, fast).disk)  # the links move nothing the disks read
    row = 3584 * wire  # a token's latent row, out and its sum back
    boundary = plan.stages[0].end
    state = (1 + -(-boundary // 12)) * 7168 * wire  # (1 + blocks) x D entering the second stage
    calls = 0.0
    for layer in k3.moe_layers:
        b = plan.experts.bounds_of(layer)
        owner = 0 if layer < boundary else 1
        other = 1 - owner
        s = (b[other + 1] - b[other]) / 896
        calls += 0.004 + 2 * (1 - (1 - s) ** 16) * row / 50e6  # the other holder gets it with prob. 1 - (1-s)^16
    # a call a stage: ids in, the state out and relayed in as it comes (one crossing's time), the logits back
    hops = 2 * 0.004 + (4 + state + 163840 * 4) / 50e6
    assert t.link == pytest.approx(calls + hops, rel=1e-6)
    assert t.total == pytest.approx(t.disk + t.link, rel=1e-6)  # a token waits on its calls


def test_a_prompt_divides_the_experts_so_that_the_other_holder_finishes_with_the_owner(k3):
    """One 512-token forward, two Macs, Wi-Fi (4 ms, 50 MB/s), compute not known: the other holder of a layer
    receives its tokens' rows (~7 MB: 0.15 s) before it computes and sends their sums after, so a prompt's call gives
    it that much fewer experts (plan/cluster/prompt_split.py): both finish after half its crossings more than over a
    free link, where the two disks split every layer evenly. The disks' part is the slowest holder's reads."""
    n, row = 512, 3584 * 4
    plan = plan_layers(k3, _macs(2), experts="wide", links=Links(assumed=profile(4.0, 400)))
    fast = plan_layers(k3, _macs(2), experts="wide", links=Links(assumed=profile(0.0, 10**9)))
    boundary = plan.stages[0].end
    state = (1 + -(-boundary // 12)) * 7168 * 4
    crossings = len(k3.moe_layers) * (0.004 + 2 * n * row / 50e6)  # every token's row out and its sum back
    hops = 2 * 0.004 + (4 * n + state * n + 163840 * 4) / 50e6
    p, q = prefill_seconds(k3, plan, n, forward_tokens=n), prefill_seconds(k3, fast, n, forward_tokens=n)
    assert p.compute == q.compute == 0
    # the caches (~1 % of the experts each) and whole experts leave the halves a little uneven
    assert p.total - q.total == pytest.approx(hops + crossings / 2, rel=0.05)
    assert p.disk - q.disk == pytest.approx(crossings / 2, rel=0.05)  # the owner reads what the other no longer does


def test_over_a_link_slower_than_the_disks_a_prompt_keeps_its_experts_at_the_owner(k3):
    """Wi-Fi scaled to 250 MB/s disks: a 4K prompt's rows would take a minute a layer each way, against 2.4 s of
    reads, so every layer's experts stay with the stage that owns it and only the stages' hops cross."""
    slow = Links(assumed=profile(4.0, 15))
    plan = plan_layers(k3, _macs(2), experts="wide", links=slow)
    p = prefill_seconds(k3, plan, 4096)
    step = min(s.plan.forward_tokens for s in plan.stages)
    forwards = [min(step, 4096 - done) for done in range(0, 4096, step)]
    assert p.link == pytest.approx(sum(hops_seconds(k3, plan, f, 4) for f in forwards), rel=1e-9)
    assert p.total == pytest.approx(p.disk + p.link, rel=1e-9)  # one disk a layer, then the hops


def test_a_stage_ending_on_its_dense_layer_sends_its_states_while_it_computes(k3):
    """K3's first layer alone on one Mac (it holds no other), over Wi-Fi: its 4K prompt's states (235 MB, 4.7 s)
    leave in 16 pieces as they are done, so only what the link still has to carry once the layer's compute ends adds
    to the hop; a simulation of the pieces and the link says how much. A forward of one piece, or a stage that ends on
    an MoE layer, sends its states after it is done."""
    from dataclasses import replace

    from deltafin.plan.cluster.compute import spine_seconds
    from tests.deltafin.plan.cluster.test_compute import SPEED

    macs = [WorkerCapacity("m0", 56 * GB, 6.6, ((0, 1),), True, address="m0:1", device="mps", worker_id="m0",
                           compute=SPEED, expert_layers=((0, 93),)),
            WorkerCapacity("m1", 56 * GB, 6.6, ((0, 93),), True, address="m1:1", device="mps", worker_id="m1",
                           compute=SPEED)]
    plan = plan_layers(k3, macs, experts="wide", links=Links(assumed=profile(4.0, 400)))
    assert [(s.start, s.end) for s in plan.stages] == [(0, 1), (1, 93)]
    blind = replace(plan, stages=(replace(plan.stages[0], compute=None), plan.stages[1]))
    n, pieces = 4096, 16
    hop = n * 2 * 7168 * 4 / 50e6  # P and the embedding, fp32, at 50 MB/s
    compute = spine_seconds(k3, SPEED, 0, 1, n, plan.stages[0].plan.spine)
    link_free = 0.0
    for i in range(1, pieces + 1):  # piece i is done at i * compute / pieces, and waits for the link
        link_free = max(i * compute / pieces, link_free) + hop / pieces
    after = link_free - compute
    assert hops_seconds(k3, plan, n, 4) - hops_seconds(k3, blind, n, 4) == pytest.approx(after - hop, rel=1e-6)
    assert hops_seconds(k3, plan, 128, 4) == pytest.approx(hops_seconds(k3, blind, 128, 4), rel=1e-12)
    moe = plan_layers(k3, [replace(m, compute=SPEED) for m in _macs(2)], experts="wide",
                      links=Links(assumed=profile(4.0, 400)))
    stripped = replace(moe, stages=tuple(replace(s, compute=None) for s in moe.stages))
    assert hops_seconds(k3, moe, n, 4) == pytest.approx(hops_seconds(k3, stripped, n, 4), rel=1e-12)


def _pipeline(times: list[float], forwards: int) -> float:
    """When the last of `forwards` equal forwards leaves the last stage, each stage taking them in order: forward k
    enters stage s once stage s is done with k - 1 and stage s - 1 with k (a schedule, simulated)."""
    done = [[0.0] * len(times) for _ in range(forwards)]
    for k in range(forwards):
        for s, t in enumerate(times):
            done[k][s] = max(done[k][s - 1] if s else 0.0, done[k - 1][s] if k else 0.0) + t
    return done[-1][-1]


def test_a_prompt_of_several_forwards_goes_through_the_stages_at_once(k3):
    """Two Macs, local experts, 64K context, a prompt of three forwards: the plan's first token is one
    forward's way through both, then what the simulated schedule of the stages adds, well under the forwards one
    after another; wide, never less than the holders' reads of every forward."""
    from tests.deltafin.plan.cluster.test_compute import SPEED  # here, as the test above takes it

    macs = [dataclasses.replace(m, compute=SPEED) for m in _macs(2)]
    links = Links(assumed=profile(0.1, 20000))
    plan = plan_layers(k3, macs, SizingInput(context=65536), experts="local", links=links)
    tokens = 3 * prompt_forward(plan)  # three forwards of equal length
    lengths = forward_lengths(tokens, prompt_forward(plan))
    assert len(plan.stages) == 2 and len(lengths) == 3 and len(set(lengths)) == 1
    one = _forward(k3, plan, lengths[0], 4, overlap=True).total
    busy = _stage_busy(k3, plan, lengths[0], 4)
    assert sum(busy) + hops_seconds(k3, plan, lengths[0], 4) == pytest.approx(one, rel=1e-9)
    got = prefill_seconds(k3, plan, tokens).total
    assert got == pytest.approx(one + _pipeline(busy, len(lengths)) - _pipeline(busy, 1), rel=1e-6)
    assert got < 0.75 * one * len(lengths)
    wide = plan_layers(k3, macs, SizingInput(context=65536), experts="wide", links=links)
    n = forward_lengths(65536, prompt_forward(wide))
    shared = sum(r for r, _, _, _ in _wide_layers(k3, wide, wide.links, n[0], True))
    seconds = prefill_seconds(k3, wide, 65536)
    assert seconds.total >= (len(n) - 1) * shared
    assert seconds.total <= sum(_forward(k3, wide, x, 4, overlap=True).total for x in n) * (1 + 1e-9)
