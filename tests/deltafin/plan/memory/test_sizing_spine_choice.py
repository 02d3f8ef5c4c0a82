"""The spine format `auto` chooses and why, what streamed layers of a converted spine cost, and the one-worker
defaults (one sequence, the expert cache before a long forward): pure planner tests on the full K3 preset's config
(no checkpoint), against independent references (the converter's own file sizes, the caches' formula)."""

from __future__ import annotations

import logging

import pytest

from deltafin.checkpoint.config import parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.cli.inspection import memory_plan, plan_lines
from deltafin.models.pieces import PIECE_TOKENS
from deltafin.plan.cluster.cluster_plan import WorkerCapacity
from deltafin.plan.memory.layer_table import layer_table, matrix_format, placed_bytes, tensor_role
from deltafin.plan.memory.sizing import Placement, SizingInput, choose, kept_while_lent, lent, size_stage
from deltafin.plan.memory.sizing_options import SEQUENCES
from deltafin.plan.memory.spine_copies import converted_unit_bytes, layer_unit
from deltafin.plan.memory.stage_plan import Budget
from deltafin.plan.planner import plan_layers

GB = 10**9
MAC = Placement("mps", experts="mlx")  # a 64 GB Mac: its routed experts run on MLX
MAC_BUDGET = Budget(56 * GB)  # Metal's working set on a 64 GB Mac, less the margin


@pytest.fixture(scope="module")
def k3():
    return parse_config(preset_config("k3"))


def one_sequence(cfg, tokens: int = 16384) -> int:
    """One K3 sequence's caches at `tokens` tokens, from K3_SPEC's widths (fp32): 69 KDA layers' conv windows and
    recurrent states, 24 MLA layers' 576-value latents a token."""
    kda = 69 * (3 * (cfg.conv_kernel - 1) * 12288 + 96 * 128 * 128) * 4
    return kda + 24 * tokens * 576 * 4


def test_a_64gb_mac_holds_the_whole_spine_in_q4_and_lends_its_cache_to_prompts(k3):
    """No flags: int8 would stream, so auto takes q4; every layer resident, nothing streamed, one sequence of 16K
    tokens and one kept prefix, one attention piece's forward beside an 11 GB expert cache, and a prompt's forward
    as long as the memory holds with the cache lent to it: the whole context (at 64K, the longest that fits)."""
    s = choose(k3, 0, 93, MAC, MAC_BUDGET, SizingInput())
    assert s.spine == "q4" and s.resident_layers == tuple(range(93)) and not s.streamed_layers
    assert s.spine_bytes_per_token == 0 and s.device_total <= 56 * GB
    assert s.expert_cache >= 11 * GB and s.device_total > 55.9 * GB  # the cache takes the rest
    assert s.sequences == 1 and s.context == 16384 and s.sessions == s.prefixes == one_sequence(k3)
    assert s.forward_tokens == PIECE_TOKENS and s.prompt_tokens == 16384  # the whole context in one forward
    assert MAC_BUDGET.fits(lent(k3, s, MAC, SizingInput(), s.prompt_tokens))
    longer = choose(k3, 0, 93, MAC, MAC_BUDGET, SizingInput(context=65536))  # a context the lent memory cannot hold
    assert 8192 < longer.prompt_tokens < 65536 and MAC_BUDGET.fits(lent(k3, longer, MAC, SizingInput(),
                                                                        longer.prompt_tokens))
    assert not MAC_BUDGET.fits(lent(k3, longer, MAC, SizingInput(), longer.prompt_tokens + 1))
    # a 4K prompt's forward leaves most of the cache to read the next layer's experts ahead (several GB: a
    # layer's attention at 10 TFLOP/s is ~0.5 s of a 6.6 GB/s disk)
    assert kept_while_lent(k3, s, MAC, 4096) > 6 * GB
    assert s.spine_why.startswith("int8 would stream ") and "+0.78 % perplexity" in s.spine_why
    assert "docs/k3-mini.md" in s.spine_why and s.spine_why in s.describe()


def test_the_planner_gives_one_mac_the_same_plan_and_says_why(k3, caplog):
    mac = WorkerCapacity("mac", 56 * GB, 6.6, ((0, 93),), True, device="mps")
    with caplog.at_level(logging.INFO, logger="deltafin.plan.planner"):
        plan = plan_layers(k3, [mac])
    (stage,) = plan.stages
    alone = choose(k3, 0, 93, MAC, MAC_BUDGET, SizingInput())
    assert (stage.plan.spine, stage.plan.expert_cache, stage.plan.forward_tokens) == (
        "q4", alone.expert_cache, alone.forward_tokens)
    assert "int8 spine" in stage.plan.spine_why and "+0.78 %" in stage.plan.spine_why
    assert any(r.getMessage().startswith("spine q4 on 1 stage(s): ") for r in caplog.records)
    table = plan.table()
    assert "spine q4: " in table and "1 sequence(s)" in table and "expert cache 11." in table


def test_auto_keeps_bf16_or_int8_where_the_whole_spine_fits(k3):
    gpu = choose(k3, 0, 93, Placement("cuda"), Budget(132 * GB, 110 * GB), SizingInput())
    assert gpu.spine == "bf16" and not gpu.streamed_layers and gpu.spine_why == "the whole spine fits as stored"
    big_mac = choose(k3, 0, 93, MAC, Budget(72 * GB), SizingInput())
    assert big_mac.spine == "int8" and not big_mac.streamed_layers
    assert big_mac.spine_why.startswith("bf16 would stream ") and "-0.01 % perplexity" in big_mac.spine_why
    # clusters: one format for all, the first the workers hold whole
    two = [WorkerCapacity(f"m{i}", 56 * GB, 6.6, ((0, 93),), True, device="mps", worker_id=str(i)) for i in range(2)]
    four = [WorkerCapacity(f"m{i}", 56 * GB, 6.6, ((0, 93),), True, device="mps", worker_id=str(i)) for i in range(4)]
    for workers, spine in ((two, "int8"), (four, "bf16")):
        plan = plan_layers(k3, workers, experts="wide")
        assert {s.plan.spine for s in plan.stages} == {spine}
        assert all(not s.plan.streamed_layers and s.plan.sequences == SEQUENCES for s in plan.stages)


def test_streamed_layers_of_a_converted_spine_cost_their_converted_files(k3):
    """Where even q4 does not fit whole, the tail streams as the converter writes it: each layer's file (its
    arrays at 64 bytes, padded to 4 KiB blocks), read whole into buffers of the largest; a Mac copies each
    layer's tensors as placed in q4. A bf16 spine still streams its tensors as stored."""
    s = choose(k3, 0, 93, MAC, Budget(40 * GB), SizingInput())
    assert s.spine == "q4" and s.streamed_layers and "layers still stream, read as converted" in s.spine_why
    files = [converted_unit_bytes(k3, layer_unit(i), "q4") for i in s.streamed_layers]
    assert s.spine_bytes_per_token == sum(files) and s.stream_buffers == 2 * max(files)
    placed = [sum(placed_bytes(t, tensor_role(t, k3.layer_kinds[i]), MAC, "q4") for t in k3.layer_tensor_specs(i))
              for i in s.streamed_layers]
    assert s.stream_copies == 2 * max(placed)
    stored = sum(t.nbytes for i in s.streamed_layers for t in k3.layer_tensor_specs(i))
    assert 0.3 * stored < s.spine_bytes_per_token < 0.4 * stored  # about a third of the layers as stored
    bf16 = size_stage(k3, 0, 93, MAC, "bf16", 0, 80, SizingInput(prefill_chunk=512))
    assert bf16.spine_bytes_per_token == sum(t.nbytes for i in range(80, 93) for t in k3.layer_tensor_specs(i))
    assert layer_table(k3, MAC).streamed("bf16").stored == layer_table(k3, MAC).stored


def test_streamed_and_resident_matrices_share_the_spines_format():
    assert [matrix_format(f, r) for f in ("bf16", "int8", "q4") for r in (True, False)] == [
        "stored", "stored", "int8", "int8", "q4", "q4"]


def test_the_one_worker_defaults_give_way_to_the_flags(k3):
    base = choose(k3, 0, 93, MAC, MAC_BUDGET, SizingInput())
    four = choose(k3, 0, 93, MAC, MAC_BUDGET, SizingInput(sequences=4))  # serving four: 4,096 tokens each
    assert four.sequences == 4 and four.sessions == four.prefixes == 4 * one_sequence(k3, 4096)
    assert four.expert_cache < base.expert_cache and four.prompt_tokens < base.prompt_tokens
    short = choose(k3, 0, 93, MAC, MAC_BUDGET, SizingInput(context=4096))
    assert short.sessions == one_sequence(k3, 4096) and short.expert_cache > base.expert_cache
    assert short.prompt_tokens == 4096  # the whole context, borrowing the cache
    long = choose(k3, 0, 93, MAC, MAC_BUDGET, SizingInput(prefill_chunk=4096))  # a forward size given: not lent
    assert long.forward_tokens == long.prompt_tokens == 4096 and long.spine == "q4"
    assert long.expert_cache == pytest.approx(base.expert_cache - (long.workspace - base.workspace), abs=2e7)
    off = choose(k3, 0, 93, MAC, MAC_BUDGET, SizingInput(prefix_cache_bytes=0))  # what the prefixes free
    assert off.prefixes == 0 and off.expert_cache > base.expert_cache and off.prompt_tokens >= base.prompt_tokens
    # a stage of part of the layers (a cluster's, local experts) plans SEQUENCES of 4,096 tokens, and lends too
    part = choose(k3, 0, 46, MAC, MAC_BUDGET, SizingInput())
    assert part.sequences == SEQUENCES and part.forward_tokens == PIECE_TOKENS and part.prompt_tokens == 4096


def test_inspect_shows_the_trade(k3):
    """`inspect --memory-gb 56 --device mps` prints the choice and why, the parts, a prompt's forward with the cache
    lent, and each default given back (a shorter context, a forward that keeps the cache, more sequences) with the
    cache it would leave."""
    plan = memory_plan(k3, 56 * GB, "mps")
    flags = {t["flags"]: t for t in plan["trade"]}
    assert set(flags) == {"--max-context 4096", "--prefill-chunk 4096", "--sequences 4"}
    assert flags["--max-context 4096"]["expert_cache"] > plan["expert_cache"]  # the sessions' room
    assert flags["--max-context 4096"]["prompt_tokens"] == 4096
    assert flags["--prefill-chunk 4096"]["expert_cache"] < plan["expert_cache"]
    assert flags["--prefill-chunk 4096"]["prompt_tokens"] == 4096 == flags["--prefill-chunk 4096"]["forward_tokens"]
    assert flags["--sequences 4"]["expert_cache"] < plan["expert_cache"]
    text = "\n".join(plan_lines(plan, 93))
    assert "q4 spine, 93 of 93 layers resident" in text and "spine q4: int8 would stream" in text
    assert "with --prefill-chunk 4096: q4 spine, 93 layers resident, expert cache" in text
    assert "sessions for 1 sequence(s) of up to 16,384 tokens" in text
    assert f"up to 512 tokens beside the expert cache, a prompt's up to {plan['prompt_tokens']:,}" in text
    fixed = memory_plan(k3, 56 * GB, "mps", SizingInput(sequences=2, prefill_chunk=2048, context=16384))
    assert fixed["trade"] == [] and fixed["sequences"] == 2 and fixed["forward_tokens"] == 2048
