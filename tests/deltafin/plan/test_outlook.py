"""What `plan` prints beyond the plan: prompts its context refuses, planned with the context they need, and every
prompt length with twice the memory, each from the plan made again (here: the planner itself, on K3 and one 64 GB
Mac's budget, against the plans made directly)."""

from __future__ import annotations

import dataclasses

import pytest

from deltafin.checkpoint.config import parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.expert_modes import parse, read_share
from deltafin.plan.cluster_plan import WorkerCapacity
from deltafin.plan.compute import assumed_gpu
from deltafin.plan.outlook import outlook
from deltafin.plan.planner import plan_layers
from deltafin.plan.sizing import SizingInput

GB = 10**9


@pytest.fixture(scope="module")
def k3():
    return parse_config(preset_config("k3"))


def test_one_mac_says_what_a_longer_context_and_more_memory_give(k3):
    mac = WorkerCapacity("mac", 56 * GB, 6.6, ((0, 93),), True, device="mps", worker_id="m",
                         compute=assumed_gpu(k3, 400.0, 10.0))

    def replan(options: SizingInput, scale: float):
        return plan_layers(k3, [dataclasses.replace(mac, memory_bytes=int(56 * GB * scale))], options)

    plan = replan(SizingInput(), 1.0)
    assert plan.context == 16384
    line = plan.first_token_line()
    assert "64K over the context (16,384 tokens): --max-context plans for more" in line
    assert f"16K {dict(plan.first_token)[16384].describe()}" in line and "the expert cache lent to them" in line
    longer, bigger, modes = outlook(plan, k3, SizingInput(), replan)
    wide = replan(SizingInput(context=65536), 1.0)
    step = wide.stages[0].sizing.spill_tokens  # past the lent forward, a prompt spills (plan/spill_cost.py)
    assert step > 2 * wide.stages[0].sizing.prompt_tokens
    assert longer.startswith(f"with --max-context 65536 (prompts in forwards of up to {step:,} tokens, spilled): 64K "
                             f"{dict(wide.first_token)[65536].describe()}")
    cache = sum(s.sizing.expert_cache for s in wide.workers) / GB
    assert f"expert cache {cache:.1f} GB (now {plan.workers[0].sizing.expert_cache / GB:.1f})" in longer
    double = replan(SizingInput(), 2.0)
    assert bigger.startswith(f"with twice the memory on every worker (context {double.context:,} tokens, prompts in "
                             f"forwards of up to 16,384 tokens): 1K {dict(double.first_token)[1024].describe()}")
    # a token in each mode that reads less, each the plan made again with the mode's share of the reads
    top_p = replan(SizingInput(expert_read_share=read_share(parse("top-p:0.5"))), 1.0).token.total
    assert f"exact {plan.token.total:.3g} s ({1 / plan.token.total:.3g} tok/s) (this plan)" in modes
    assert f"top-p:0.5 {top_p:.3g} s ({1 / top_p:.3g} tok/s)" in modes and top_p < 0.7 * plan.token.total
    assert ", cached:0.05 " not in modes  # planned as exact: nothing to show
    # the user's own context: nothing over it to plan for
    asked = replan(SizingInput(context=65536), 1.0)
    assert [x.split(" (")[0] for x in outlook(asked, k3, SizingInput(context=65536), replan)] == [
        "with twice the memory on every worker", "a token in each expert mode"]
