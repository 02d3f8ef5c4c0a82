"""A context sized by memory (pure): the model's own maximum where memory holds it, else the longest the room the
plan leaves holds, never taking the expert cache's room; K3 on a 64 GB Mac stays at one user's base and says
what more would cost; a cluster's stages share one; a context asked for is kept."""

from __future__ import annotations

import pytest

from deltafin.checkpoint.config import load_config, parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.paths import bundled_model
from deltafin.plan.cluster.cluster_plan import WorkerCapacity
from deltafin.plan.memory.context import STEP, at_context, cost_per_1k, grown, longest_context
from deltafin.plan.memory.sizing import Placement, SizingInput, choose
from deltafin.plan.memory.sizing_options import BASE_CONTEXT, ONE_USER_CONTEXT
from deltafin.plan.memory.stage_plan import Budget
from deltafin.plan.planner import plan_layers

GB = 10**9
MAC = Placement("mps", experts="mlx")


@pytest.fixture(scope="module")
def k3():
    return parse_config(preset_config("k3"))


@pytest.fixture(scope="module")
def mini():
    return load_config(bundled_model())


def test_k3_on_a_64gb_mac_keeps_one_users_base_context_and_says_what_more_costs(k3):
    budget = Budget(56 * GB)
    base = choose(k3, 0, 93, MAC, budget, SizingInput())
    s = grown(k3, base, MAC, budget, SizingInput())
    assert s.context == ONE_USER_CONTEXT == base.context and s.expert_cache == base.expert_cache  # the cache keeps all
    # a sequence's MLA latents and the kept prefix beside it: 24 layers x 576 values x fp32, per token, twice
    latents = 2 * 24 * 576 * 4 * STEP
    assert latents <= cost_per_1k(k3, s, MAC, SizingInput()) < latents + 0.02 * GB  # + attention workspace
    plan = plan_layers(k3, [WorkerCapacity("mac", 56 * GB, 6.6, ((0, 93),), True, device="mps")])
    assert plan.context == ONE_USER_CONTEXT
    assert "each 1,024 tokens more would take 0.11 GB of a stage's memory from its expert cache" in plan.table()


def test_a_small_model_gets_its_own_maximum_where_memory_holds_it(mini):
    s = grown(mini, choose(mini, 0, 8, Placement(), Budget(20 * GB), SizingInput()), Placement(), Budget(20 * GB),
              SizingInput())
    assert s.context == mini.max_context == 1 << 20 and s.device_total <= 20 * GB


def test_where_memory_is_short_the_context_is_the_longest_it_holds_and_the_cache_keeps_its_room(mini):
    budget, opts = Budget(3 * GB), SizingInput(sequences=4)
    base = choose(mini, 0, 8, Placement(), budget, opts)
    longest = longest_context(mini, base, Placement(), budget, opts)
    assert BASE_CONTEXT < longest < mini.max_context and longest % STEP == 0
    at = at_context(mini, base, Placement(), opts, longest)
    assert budget.fits(at) and not budget.fits(at_context(mini, base, Placement(), opts, longest + STEP))
    assert (at.expert_cache, at.resident_layers, at.forward_tokens, at.spine) == (
        base.expert_cache, base.resident_layers, base.forward_tokens, base.spine)


def test_a_context_asked_for_is_the_plan_s(mini):
    opts = SizingInput(context=2048)
    s = choose(mini, 0, 8, Placement(), Budget(20 * GB), opts)
    assert grown(mini, s, Placement(), Budget(20 * GB), opts).context == 2048
    plan = plan_layers(mini, [WorkerCapacity("w", 20 * GB, 2.0, ((0, 8),), True)], opts)
    assert plan.context == 2048 and "as asked (--max-context)" in plan.table()


def test_a_cluster_s_stages_share_the_least_of_their_contexts(mini):
    """Two workers, one with less memory: both stages are planned for what the smaller one holds, and a 13.5K-token
    prompt fits (a 6-layer model through two workers with defaults was refused at 4,096 tokens)."""
    workers = [WorkerCapacity("big", 8 * GB, 2.0, ((0, 8),), True, address="big:1", worker_id="big"),
               WorkerCapacity("small", 2 * GB, 2.0, ((0, 8),), True, address="small:1", worker_id="small")]
    plan = plan_layers(mini, workers, experts="local")
    assert len(plan.stages) == 2 and {s.plan.context for s in plan.stages} == {plan.context}
    assert 13_520 + 512 < plan.context < mini.max_context
    small = next(s for s in plan.stages if s.worker == "small")
    assert not Budget(small.memory_bytes).fits(at_context(mini, small.plan, Placement(), SizingInput(disks=1),
                                                          plan.context + STEP))
