"""Planner: pure-function tests on the real K3 config and small made-up clusters."""

from __future__ import annotations

import pytest

from deltafin.checkpoint.config import parse_config
from deltafin.errors import PlanError
from deltafin.plan.cluster.cluster_plan import WorkerCapacity
from deltafin.plan.memory.sizing import SizingInput
from deltafin.plan.planner import plan_layers

GB = 10**9
INT8 = SizingInput(spine="int8")


@pytest.fixture(scope="module")
def k3(k3_config_raw):
    return parse_config(k3_config_raw)


def _w(name, mem_gb, layers=((0, 93),), top=True, bw=6.6):
    return WorkerCapacity(name, int(mem_gb * GB), bw, layers, top)


def _covers_once(plan, n):
    ranges = [(s.start, s.end) for s in plan.stages]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:], strict=False))


def test_equal_workers_get_equal_shares(k3):
    plan = plan_layers(k3, [_w(f"m{i}", 64) for i in range(4)], options=INT8)
    _covers_once(plan, 93)
    spines = [s.spine_bytes for s in plan.stages]
    assert max(spines) / min(spines) < 1.15 and all(s.streamed_bytes == 0 for s in plan.stages)


def test_memory_weighted(k3):
    plan = plan_layers(k3, [_w("big", 96), _w("small", 32)], options=INT8)
    _covers_once(plan, 93)
    big, small = plan.stages
    assert 2.4 < big.spine_bytes / small.spine_bytes < 3.6  # spines roughly proportional to memory (3:1)


def test_faster_disk_takes_more_layers(k3):
    """With local experts each stage reads its own layers' experts from its own disk: the fast disk takes more
    layers (here all: its tail streams as converted int8, cheaper than the slow disk's expert reads)."""
    plan = plan_layers(k3, [_w("fast", 64, bw=13.2), _w("slow", 64, bw=3.3)], options=INT8)
    layers = {s.worker: s.end - s.start for s in plan.stages}
    assert layers["fast"] > layers.get("slow", 0)


def test_respects_the_layers_each_worker_has(k3):
    ws = [_w("a", 64, ((0, 50),)), _w("b", 64, ((40, 93),))]
    plan = plan_layers(k3, ws, options=INT8)
    _covers_once(plan, 93)
    a, b = plan.stages
    assert a.worker == "a" and a.end <= 50 and b.worker == "b" and b.start >= 40


def test_first_and_last_stages_need_the_embedding_and_head(k3):
    ws = [_w("head", 64), _w("middle", 64, top=False), _w("tail", 64)]
    plan = plan_layers(k3, ws, options=INT8)
    assert plan.stages[0].worker == "head" and plan.stages[-1].worker == "tail"
    with pytest.raises(PlanError, match="embedding/head"):
        plan_layers(k3, [_w("x", 256, top=False)], options=INT8)


def test_one_mac_streams_what_does_not_fit(k3):
    plan = plan_layers(k3, [_w("mac", 56)], options=INT8)
    (stage,) = plan.stages
    assert stage.streamed_bytes > 0 and stage.spine_bytes < 56 * GB


def test_refusals_are_specific(k3):
    with pytest.raises(PlanError, match="no worker holds layers 50-92"):
        plan_layers(k3, [_w("a", 64, ((0, 50),))], options=INT8)
    with pytest.raises(PlanError, match="tiny has 2.00 GB on cpu, and the least any stage of this model needs"):
        plan_layers(k3, [_w("tiny", 2)], options=INT8)
    with pytest.raises(PlanError, match="no workers"):
        plan_layers(k3, [], options=INT8)


def test_a_worker_below_the_least_stage_is_named_without_advising_more_workers(k3):
    """A worker whose budget holds not even its smallest stage (one layer, or an expert holder) is named with its
    budget and that least, and told that more workers do not help; the advice to add workers was wrong for it."""
    opts = SizingInput(spine="int8", sequences=1)
    with pytest.raises(PlanError) as refused:
        plan_layers(k3, [_w("big", 8), _w("small", 1.5)], options=opts)
    message = str(refused.value)
    assert message.startswith("small has 1.50 GB on cpu, and the least any stage of this model needs there is 2.")
    assert "big" not in message and "more workers do not help" in message and "add memory or workers" not in message


def test_table_lists_every_stage(k3):
    plan = plan_layers(k3, [_w("m0", 64), _w("m1", 64)], options=INT8)
    table = plan.table()
    assert "m0" in table and "m1" in table and "total" in table and f"{plan.stages[0].start}-" in table


# ---- wide experts ---------------------------------------------------------------------------------------------


def _wk(name, mem_gb, bw=6.6, experts=None, layers=((0, 93),), device="cpu"):
    return WorkerCapacity(name, int(mem_gb * GB), bw, layers, True, worker_id=name, expert_layers=experts,
                          device=device)


def test_wide_shares_follow_disk_speed_and_spread_every_token(k3):
    fast, slow = _wk("fast", 64, bw=9.9), _wk("slow", 64, bw=3.3)
    local = plan_layers(k3, [fast, slow], INT8)
    wide = plan_layers(k3, [fast, slow], INT8, experts="wide")
    assert local.experts is None and wide.experts is not None and wide.experts.layers == k3.moe_layers
    share = [wide.experts.fraction(i) for i in range(2)]
    assert share[0] / share[1] == pytest.approx(3.0, rel=0.1)  # the same caches: shares as the disks, 3:1
    reads = [s.plan.expert_bytes_per_token / (bw * GB) for s, bw in zip(wide.stages, (9.9, 3.3), strict=True)]
    assert reads[0] == pytest.approx(reads[1], rel=0.1)  # so both disks read for the same time per token
    misses = sum(s.plan.expert_bytes_per_token for s in wide.stages)
    assert wide.seconds_per_token == pytest.approx(misses / (13.2 * GB), rel=0.1)  # both disks at once
    assert wide.seconds_per_token < 0.8 * local.seconds_per_token  # local: one disk at a time (mostly the fast)


def test_wide_plans_fit_and_grow_no_budget(k3):
    ws = [_wk(f"m{i}", 56) for i in range(4)]
    plan = plan_layers(k3, ws, experts="wide")
    for s in plan.workers:
        z = s.plan
        assert z.device_total <= s.memory_bytes and not z.experts_resident and z.expert_calls > 0
        assert z.expert_layers == len(k3.moe_layers)
    total = sum(s.plan.expert_bytes_per_token for s in plan.workers)
    per_token = len(k3.moe_layers) * k3.experts_per_token * k3.bytes_per_expert
    assert total < per_token and all(s.plan.expert_bytes_per_token < 0.3 * per_token for s in plan.workers)


def test_workers_without_layers_serve_experts_and_holders_without_bytes_get_none(k3):
    """Three 64 GB workers take the layers; a fourth holds only expert shards (no spine) and serves its share; a
    fifth holds layers 0-45 only and gets no share of the others' experts."""
    ws = [_wk(f"m{i}", 64) for i in range(3)] + [_wk("mini", 16, layers=(), experts=((0, 93),)),
                                                 _wk("half", 64, experts=((0, 46),), layers=((0, 46),))]
    plan = plan_layers(k3, ws, INT8, experts="wide")
    keys = plan.experts.holders
    assert "mini" in [s.key for s in plan.holders] and plan.workers[keys.index("mini")].plan.holder_only
    half = keys.index("half")
    assert all(not plan.experts.share(half, layer) for layer in k3.moe_layers if layer >= 46)
    assert any(plan.experts.share(half, layer) for layer in k3.moe_layers if layer < 46)
    assert "mini" in plan.table() and "total (wide)" in plan.table()


def test_local_experts_plan_as_before(k3):
    ws = [_wk(f"m{i}", 56) for i in range(2)]
    assert plan_layers(k3, ws) == plan_layers(k3, ws, experts="local")
    with pytest.raises(PlanError, match="wide or local"):
        plan_layers(k3, ws, experts="sideways")


def test_a_mac_in_a_mode_with_a_copy_plans_its_experts_one_by_one(k3):
    """A Mac runs its routed experts in MLX's one call, read in place into MLX slots (no landing slots), except in an
    expert mode that reads a low-bit copy: its stage runs them one by one (runtime/stage_build.expert_backend_for),
    so the plan places them as the stage will, with landing slots, and still fits the budget."""
    from deltafin.plan.cluster.cluster_plan import stage_placement

    mac = WorkerCapacity("mac", 56 * GB, 6.6, ((0, 93),), True, device="mps")
    copy = SizingInput(expert_copy="q3", expert_read_share=0.5)
    assert stage_placement(mac, 4).experts == "mlx" and stage_placement(mac, 4, copy).experts == "torch"
    assert stage_placement(_w("linux", 56), 4, copy).experts == "torch"
    fused, one_by_one = (plan_layers(k3, [mac], options=o).stages[0].plan for o in (SizingInput(), copy))
    assert fused.expert_landing == 0 < one_by_one.expert_landing
    assert one_by_one.total <= 56 * GB
