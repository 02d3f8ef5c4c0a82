"""One stage's spine follows its disk (K3's full geometry, pure sizing): without a copy of the chosen format and
without room to write one, a copy of another format that is there is read; else the plan that needs no copy."""

from __future__ import annotations

import pytest

from deltafin.checkpoint.config import parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.plan.memory.sizing import Placement, choose
from deltafin.plan.memory.spine_copies import SpineDisk, stage_units
from deltafin.plan.memory.stage_plan import Budget
from deltafin.runtime.stage_build import without_room
from deltafin.runtime.stage_options import StageOptions

BUDGET = Budget(16 * 2**30)  # the one stage: full K3 in 16 GiB


@pytest.fixture(scope="module")
def k3():
    return parse_config(preset_config("k3"))


def _plan(k3):
    return lambda options, **known: choose(k3, 0, 93, Placement("cpu"), BUDGET, options.sizing_for(k3, None, **known))


def test_another_format_s_copy_on_the_disk_is_read(k3):
    chosen = _plan(k3)(StageOptions())
    assert chosen.spine == "q4" and chosen.streamed_layers  # what auto plans, counting on a q4 copy
    int8_there = SpineDisk({"int8": frozenset(stage_units(k3, 0, 93))}, room=0)
    s = without_room(_plan(k3), StageOptions(), chosen, int8_there, k3)
    assert (s.spine, s.converted) == ("int8", True)
    assert "no converted q4 copy of layers 0-92 and no room to write one" in s.spine_why
    assert "the converted int8 copy on the disk is read" in s.spine_why


def test_nothing_on_the_disk_runs_the_plan_that_needs_no_copy(k3):
    plan = _plan(k3)
    chosen = plan(StageOptions())
    s = without_room(plan, StageOptions(), chosen, SpineDisk({}, room=0), k3)
    assert (s.spine, s.converted) == ("int8", False) and len(s.resident_layers) >= 5
    assert s.spine_bytes_per_token < plan(StageOptions().replace(spine="bf16")).spine_bytes_per_token
    assert "int8 quantized as the resident layers load, at every start" in s.spine_why
    asked = StageOptions().replace(spine="q4")
    q4 = without_room(plan, asked, plan(asked), SpineDisk({}, room=0), k3)
    assert (q4.spine, q4.converted) == ("q4", False)  # as asked, never another format
