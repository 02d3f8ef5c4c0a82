"""A plan made elsewhere, checked where it runs (plan/memory/stage_check.py): one Mac's plan at 64K, whose prompts
borrow the expert cache and spill past that, loads within its budget, and one whose spilled forward the budget does not
hold (a planner that counted otherwise) is refused, saying which."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deltafin.checkpoint.config import parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.errors import SizingError
from deltafin.plan.memory.sizing import Placement, SizingInput, choose, lent
from deltafin.plan.memory.stage_check import check_plan
from deltafin.plan.memory.stage_plan import Budget

GB = 10**9
MAC = Placement("mps")


def test_a_spilling_plan_is_checked_for_its_spilled_forward_too():
    k3 = parse_config(preset_config("k3"))
    options = SizingInput(context=65536)
    plan = choose(k3, 0, k3.num_layers, MAC, Budget(56 * GB), options)
    assert plan.spill_tokens > plan.prompt_tokens and check_plan(k3, plan, MAC, Budget(56 * GB), options) == plan
    longer = replace(plan, spill_tokens=65536)  # spilled, the whole context in one forward: more than 56 GB holds
    assert not Budget(56 * GB).fits(lent(k3, longer, MAC, options, 65536, spilled=True))
    with pytest.raises(SizingError, match="spills 65,536-token prompt forwards"):
        check_plan(k3, longer, MAC, Budget(56 * GB), options)
