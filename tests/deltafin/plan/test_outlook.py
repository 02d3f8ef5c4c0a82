"""What `plan` prints beyond the plan: prompts its context refuses, planned with the context they need, and every
prompt length with twice the memory, each from the plan made again (here: the planner itself, on K3 and one 64 GB
Mac's budget, against the plans made directly)."""

from __future__ import annotations

import dataclasses

import pytest

from deltafin.checkpoint.config import parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.expert_modes import parse, read_share
from deltafin.plan.cluster.cluster_plan import WorkerCapacity
from deltafin.plan.cluster.compute import assumed_gpu
from deltafin.plan.memory.sizing import SizingInput
from deltafin.plan.outlook import outlook
from deltafin.plan.planner import plan_layers

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
    step = wide.stages[0].plan.spill_tokens  # past the lent forward, a prompt spills (plan/memory/spill_cost.py)
    assert step > 2 * wide.stages[0].plan.prompt_tokens
    assert longer.startswith(f"with --max-context 65536 (prompts in forwards of up to {step:,} tokens, spilled): 64K "
                             f"{dict(wide.first_token)[65536].describe()}")
    cache = sum(s.plan.expert_cache for s in wide.workers) / GB
    assert f"expert cache {cache:.1f} GB (now {plan.workers[0].plan.expert_cache / GB:.1f})" in longer
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


def test_plan_shows_a_copy_mode_and_each_workers_copy_against_its_room(k3):
    """In q3 each worker converts its own layers' experts (local) or its share of every layer's (wide): a K3 expert
    is 13.4 MB in q3 (three [3072, 3584]-sized matrices at 3 bits and an fp16 scale and bias a 128), aligned to 4 KiB;
    a worker whose disk has too little room is named."""
    from deltafin.plan.memory.sizing_options import expert_read_share
    from deltafin.plan.outlook import expert_copies, mode_lines

    mode = parse("top-p:0.55+q3")
    each = 3 * (3072 * 3584 * 3 // 8 + 4 * 3072 * 3584 // 128)
    each += -each % 4096
    assert expert_copies(k3, parse("top-p:0.55"), None) == []  # type: ignore[arg-type]  # no copy: nothing asked
    macs = [WorkerCapacity(f"mac{i}", 56 * GB, 6.6, ((0, 93),), True, device="mps", worker_id=f"m{i}",
                           compute=assumed_gpu(k3, 400.0, 10.0)) for i in range(2)]
    options = SizingInput(expert_copy="q3", expert_read_share=expert_read_share(k3, mode))
    local = plan_layers(k3, macs, options)
    wide = plan_layers(k3, macs, options, experts="wide")
    for plan in (local, wide):
        copies = expert_copies(k3, mode, plan)
        assert sum(n for _, n in copies) == 92 * 896 * each  # every expert once, over the workers
    assert [n for _, n in expert_copies(k3, mode, local)] == [
        sum(k3.is_moe(i) for i in range(s.start, s.end)) * 896 * each for s in local.stages]
    lines = mode_lines(k3, mode, expert_copies(k3, mode, wide), {"mac0": 10 * GB, "mac1": None})
    assert "top-p:0.55+q3 (lossy" in lines[0] and f"{expert_read_share(k3, mode):.3f} of exact's" in lines[0]
    assert "mac0" in lines[1] and "10.0 GB free: too little" in lines[1] and lines[1].count("too little") == 1
