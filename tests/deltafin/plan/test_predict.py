"""A plan's predicted time on K3's full geometry (pure): a decoded token's and a prompt's link time against the
bytes counted from the config by hand (the rows of the tokens each holder gets, each way, a round trip per MoE
layer; each stage's hop through the coordinator), and the disks' time unchanged by the links."""

from __future__ import annotations

import pytest

from deltafin.checkpoint.config import parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.plan.cluster_plan import WorkerCapacity
from deltafin.plan.links import Links, profile
from deltafin.plan.planner import plan_layers
from deltafin.plan.predict import prefill_seconds, token_seconds

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


def test_in_a_prompt_the_rows_cross_while_the_holders_read_and_the_sums_back_add(k3):
    """One 512-token forward, two Macs, Wi-Fi (4 ms, 50 MB/s), compute not known: a layer's rows reach the other
    holder (~7 MB: 0.15 s) well within its reads (~1 s), so only its sums' crossing back adds (less where the
    owner's own reads are the longer, its share being the larger), and the hops."""
    n, row = 512, 3584 * 4
    plan = plan_layers(k3, _macs(2), experts="wide", links=Links(assumed=profile(4.0, 400)))
    fast = plan_layers(k3, _macs(2), experts="wide", links=Links(assumed=profile(0.0, 10**9)))
    boundary = plan.stages[0].end
    state = (1 + -(-boundary // 12)) * 7168 * 4
    back = 0.0
    for layer in k3.moe_layers:
        b = plan.experts.bounds_of(layer)
        other = 1 if layer < boundary else 0
        s = (b[other + 1] - b[other]) / 896
        back += 0.004 + n * (1 - (1 - s) ** 16) * row / 50e6
    hops = 2 * 0.004 + (4 * n + state * n + 163840 * 4) / 50e6
    p, q = prefill_seconds(k3, plan, n, forward_tokens=n), prefill_seconds(k3, fast, n, forward_tokens=n)
    assert p.disk == pytest.approx(q.disk) and p.compute == q.compute == 0
    assert hops + 0.9 * back < p.total - q.total <= hops + back + 1e-9  # rows out hidden, sums back not


def test_a_prompt_s_rows_move_while_the_holders_read(k3):
    slow = Links(assumed=profile(4.0, 15))  # Wi-Fi scaled to 250 MB/s disks
    plan = plan_layers(k3, _macs(2), experts="wide", links=slow)
    p = prefill_seconds(k3, plan, 4096)
    assert p.link > p.disk  # at K3's width a wide prompt moves more over this link than the disks read
    assert max(p.disk, p.link) <= p.total < p.disk + p.link  # overlapped, layer by layer
    local = plan_layers(k3, _macs(2), experts="local", links=slow)
    assert prefill_seconds(k3, local, 4096).link < p.link / 10  # only the hops
