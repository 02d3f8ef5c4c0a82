"""The least memory a stage plans in, against the sizing it is found with (pure): a byte below it every candidate
stage refuses, at it one plans, and above it every budget plans; the refusals quote it."""

from __future__ import annotations

import pytest

from deltafin.checkpoint.config import load_config, parse_config
from deltafin.errors import SizingError
from deltafin.paths import bundled_model
from deltafin.plan.memory.least import (
    check_fits,
    least_any,
    least_options,
    least_stage,
    shortfall,
    smallest_stages,
    too_small,
)
from deltafin.plan.memory.sizing import Placement, SizingInput, choose
from deltafin.plan.memory.stage_plan import Budget

GB = 10**9
PLACES = (Placement("cpu"), Placement("cuda"), Placement("mps", experts="mlx"))
ASKED = (SizingInput(), SizingInput(spine="int8", sequences=4, context=16384))


@pytest.fixture(scope="module")
def k3(k3_config_raw):
    return parse_config(k3_config_raw)


@pytest.fixture(scope="module")
def mini():
    return load_config(bundled_model())


def _plans(plans, budget: int) -> bool:
    try:
        plans(Budget(budget))
    except SizingError:
        return False
    return True


@pytest.mark.parametrize("place", PLACES, ids=lambda p: p.device)
@pytest.mark.parametrize("options", ASKED, ids=("defaults", "int8-4x16k"))
def test_a_stage_plans_in_every_budget_from_its_least_on(k3, mini, place, options) -> None:
    """choose refuses a byte below the least and plans at it and at every budget above (the forward a budget would
    give falls back to the shortest where it leaves no plan: without that, some budgets just above a plan refuse)."""
    for cfg in (k3, mini):
        least = least_stage(cfg, 0, cfg.num_layers, place, options)
        plans = lambda b, cfg=cfg: choose(cfg, 0, cfg.num_layers, place, b, options)
        assert not _plans(plans, least.budget - 1)
        assert choose(cfg, 0, cfg.num_layers, place, Budget(least.budget), options).device_total <= least.budget
        step = 50_000  # under one token's workspace at K3's width: a forward's growth cannot hide between steps
        assert all(_plans(plans, least.budget + d) for d in range(step, 40 * step, step))


@pytest.mark.parametrize("place", PLACES, ids=lambda p: p.device)
def test_an_expert_holder_plans_in_every_budget_from_its_least_on(k3, place) -> None:
    """As a stage does: with the coordinator's context, its calls' forward falls back to PIECE_TOKENS where the one
    a budget gives leaves no room (budgets just below a plan's once planned while that plan's refused)."""
    ((what, plans),) = smallest_stages(k3, place, SizingInput(), (), True, len(k3.moe_layers))
    least = least_any([(what, plans)])
    assert what == "an expert holder" and least.plan.forward_tokens == 512
    assert not _plans(plans, least.budget - 1)
    assert all(_plans(plans, least.budget + d) for d in range(0, 2 * GB, 10_000_000))


def test_the_refusal_says_the_least_and_that_much_plans(k3) -> None:
    """The "at least" of choose's refusal (at any budget below) is the least; giving it, rounded up as printed,
    plans. It was the need at the forward the small budget gave, and a budget that large then chose a longer one."""
    place, options = Placement("cpu"), SizingInput()
    least = least_stage(k3, 0, k3.num_layers, place, options)
    for budget in (GB, least.budget - 1):
        with pytest.raises(SizingError, match=f"at least {least.budget / GB:.2f} GB"):
            choose(k3, 0, k3.num_layers, place, Budget(budget), options)
    assert choose(k3, 0, k3.num_layers, place, Budget(int(float(least.gb.split()[0]) * GB)), options)
    with pytest.raises(SizingError) as refused:
        check_fits(k3, 0, k3.num_layers, place, Budget(GB), options)
    message = str(refused.value)
    assert f"they need at least {least.gb} (" in message and "the budget is 1.00 GB" in message
    assert "more workers" not in message and "\n" not in message


@pytest.mark.parametrize("place", PLACES, ids=lambda p: p.device)
def test_a_workers_least_is_its_smallest_stage(k3, mini, place) -> None:
    """Of one layer alone and an expert holder, the least: a byte below it no candidate plans, at it one does."""
    for cfg in (k3, mini):
        stages = smallest_stages(cfg, place, least_options(SizingInput()), range(cfg.num_layers), True,
                                 len(cfg.moe_layers))
        assert len(stages) == cfg.num_layers + 1  # every layer alone, and the holder
        least = least_any(stages)
        assert not any(_plans(plans, least.budget - 1) for _, plans in stages)
        assert [what for what, plans in stages if _plans(plans, least.budget)] == [least.what]
        assert shortfall(stages, least.budget) is None and shortfall(stages, least.budget - 1) == least


def test_the_candidates_are_what_the_worker_could_take(k3) -> None:
    """Without the embedding/head the first and last layers are no stage of its own; without experts, no holder."""
    opts = least_options(SizingInput())
    names = [what for what, _ in smallest_stages(k3, Placement(), opts, (0, 1, 92), False, 0)]
    assert names == ["layers 1-1"]
    with pytest.raises(SizingError, match="holds no layer a stage can take"):
        least_any(smallest_stages(k3, Placement(), opts, (0, 92), False, 0))


def test_the_least_beats_the_runtime_alone_and_the_options_asked_raise_it(mini) -> None:
    """k3-mini's least is its runtime and little more (the issue's 0.3 GB worker cannot work); a coordinator that
    asks more of every stage (sequences, context) raises a layer's (a holder keeps no sequences)."""
    least = least_any(smallest_stages(mini, Placement(), least_options(SizingInput()), range(8), True, 7))
    assert 1 << 30 < least.budget < 1.2 * GB
    layer = least_any(smallest_stages(mini, Placement(), least_options(SizingInput()), range(8), True, 0))
    asked = least_any(smallest_stages(mini, Placement(), SizingInput(sequences=8, context=65536), range(8), True, 0))
    assert asked.budget > layer.budget >= least.budget


def test_too_small_names_each_worker_its_budget_and_the_least(mini) -> None:
    opts = least_options(SizingInput())
    worker = lambda name, gb: (name, int(gb * GB), Placement(), range(8), True, 7)
    assert too_small(mini, [worker("big", 4)], opts) is None
    said = too_small(mini, [worker("big", 4), worker("small", 0.3)], opts)
    least = least_any(smallest_stages(mini, Placement(), opts, range(8), True, 7))
    assert said is not None and said.startswith(f"small has 0.30 GB on cpu, and the least any stage of this model "
                                                f"needs there is {least.gb}")
    assert "big" not in said and "more workers do not help" in said
