"""When the plan spills a prompt's forward (plan/memory/spill_cost.py, sizing.py `_spill`) and what it prices: pure
planner tests on the full K3 preset's config (no checkpoint), against the spec's banking rule counted layer by layer and
the experts' own bytes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deltafin.checkpoint.config import parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.plan.memory.sizing import Placement, SizingInput, choose, lent
from deltafin.plan.memory.spill_cost import pass_bytes, spill_pays, spill_read_bytes, spill_write_bytes
from deltafin.plan.memory.stage_plan import Budget

GB = 10**9
MAC = Placement("mps", experts="mlx")
MAC_BUDGET = Budget(56 * GB)


@pytest.fixture(scope="module")
def k3():
    return parse_config(preset_config("k3"))


def test_the_spill_moves_each_layers_banked_blocks(k3):
    """K3_SPEC §2: layer l banks a block where l % 12 == 0, before its attention; a layer reads the blocks banked
    before it. Counted by walking the layers, not by the formula's ceil."""
    banked, reads, writes = 0, 0, 0
    for layer in range(k3.num_layers):
        reads += banked
        if layer % k3.attn_res_block_size == 0:
            banked += 1
            writes += 1
    assert (banked, k3.hidden_size) == (8, 7168)
    for tokens, act in ((1, 4), (32768, 4), (5000, 2)):
        row = tokens * k3.hidden_size * act
        assert spill_read_bytes(k3, 0, 93, tokens, act) == reads * row
        assert spill_write_bytes(k3, 0, 93, tokens, act) == writes * row
    # a 32K-token forward in fp32: ~0.4 TB of reads and 7.5 GB of writes, against the 1.45 TB a forward more reads
    again = pass_bytes(k3, 92, 0)
    assert 1.40e12 < again < 1.50e12
    assert spill_pays(k3, 0, 93, 32768, 4, again)
    assert not spill_pays(k3, 0, 93, 200_000, 4, again)  # its blocks outweigh the experts: never planned


def test_a_64gb_mac_spills_prompts_longer_than_its_lent_forward(k3):
    """At --max-context 65536 one Mac's prompt forward holds 14.7K tokens; spilled, one holds over twice that, its
    workspace fits the budget with the cache lent, and its spill reads less than another pass over the experts."""
    options = SizingInput(context=65536)
    s = choose(k3, 0, 93, MAC, MAC_BUDGET, options)
    assert 8192 < s.prompt_tokens < 20000 and 2 * s.prompt_tokens < s.spill_tokens < 65536
    assert s.longest_forward == s.spill_tokens
    assert MAC_BUDGET.fits(lent(k3, s, MAC, options, s.spill_tokens, spilled=True))
    assert not MAC_BUDGET.fits(lent(k3, s, MAC, options, s.spill_tokens + 1024, spilled=True))
    assert not MAC_BUDGET.fits(lent(k3, s, MAC, options, s.spill_tokens))  # unspilled it would not fit
    assert spill_pays(k3, 0, 93, s.spill_tokens, 4, pass_bytes(k3, s.expert_layers, s.spine_bytes_per_token))


def test_no_spill_where_the_prompt_fits_the_lent_forward_or_the_stage_is_not_the_whole_model(k3):
    assert choose(k3, 0, 93, MAC, MAC_BUDGET, SizingInput()).spill_tokens == 0  # 16K context: one forward holds it
    off = choose(k3, 0, 93, MAC, MAC_BUDGET, SizingInput(context=65536, spill=False))
    assert off.spill_tokens == 0 and off.longest_forward == off.prompt_tokens
    part = choose(k3, 0, 47, MAC, MAC_BUDGET, replace(SizingInput(context=65536), sequences=1))
    assert part.spill_tokens == 0  # its output is every row's state: nothing to spill it into
