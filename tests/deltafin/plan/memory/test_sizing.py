"""The sizing model: its choices on the real K3 config, and planned == allocated on real stages (CPU, and a
discrete-device placement on the meta device), bf16 and int8, resident and streamed."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch

from deltafin.checkpoint.config import load_config, parse_config
from deltafin.checkpoint.shards import open_checkpoint
from deltafin.errors import SizingError
from deltafin.models.weights import ExpertWeights
from deltafin.plan.memory.layer_table import layer_table
from deltafin.plan.memory.sizing import Placement, SizingInput, choose, size_stage
from deltafin.plan.memory.sizing_options import SizingOptions
from deltafin.plan.memory.stage_parts import expert_slot_bytes
from deltafin.plan.memory.stage_plan import Budget
from deltafin.runtime.stage import Stage
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import StageOptions
from deltafin.weights.reader import layer_spans
from deltafin.weights.resident import ResidentExperts
from tests.support.sizing import held, plan_of

GB = 10**9
CPU, META = torch.device("cpu"), torch.device("meta")


@pytest.fixture(scope="module")
def k3(k3_config_raw):
    return parse_config(k3_config_raw)


# ---- choices on the real config (pure) ------------------------------------------------------------------


def test_k3_spine_as_placed_matches_its_stored_size(k3):
    """bf16 resident = the tensors as stored, but MLA's kv_b in the fp32 activation dtype (+2 bytes a value) and
    the 1-D bf16 norms as fp32 (+0.001%); int8 about half."""
    t = layer_table(k3, Placement("cpu"))
    stored = sum(t.stored)
    assert 108.7 * GB < stored < 108.9 * GB  # docs/PERF.md: 108.8 GB of non-expert layers
    kv_b = 24 * 96 * 256 * 512 * 2
    assert 0 <= t.resident("bf16")[-1] - stored - kv_b < 1e-4 * stored
    # docs/PERF.md's ~54.5 GB row-int8 counts every matrix at a byte; the routers stay bf16 (+1.2 GB) and kv_b fp32
    # (on a Mac, which copies every tensor off the converted file it read) ...
    routers = 92 * 896 * 7168
    mac = layer_table(k3, Placement("mps"))
    assert 54.0 * GB < mac.resident("int8")[-1] - routers - 3 * kv_b // 2 < 55.0 * GB
    # ... while the CPU keeps each converted layer's file, whose matrices it uses in place: kv_b's bf16 bytes stay
    # there beside its fp32 copy, as do the vectors' stored bytes (KDA's fp32 convolutions: 41 MB), and every
    # layer's file is padded to whole 4 KiB blocks
    assert 54.0 * GB < t.resident("int8")[-1] - routers - 5 * kv_b // 2 < 55.0 * GB
    convolutions = 69 * 3 * 12288 * 4 * 4
    assert convolutions < t.resident("int8")[-1] - mac.resident("int8")[-1] - kv_b < 2 * convolutions


def test_one_64gb_mac_streams_the_int8_tail_and_every_expert(k3):
    """With the int8 spine asked for, a 64 GB Mac streams its tail, read from the converted int8 files (not as
    stored): each streamed layer costs its converted file, the files' size as the converter lays them out."""
    from deltafin.plan.memory.spine_copies import converted_unit_bytes, layer_unit

    mac = Placement("mps", experts="mlx")
    s = choose(k3, 0, 93, mac, Budget(56 * GB), SizingInput(spine="int8"))
    assert s.spine == "int8" and 40 < len(s.resident_layers) < 93 and s.streamed_layers[-1] == 92
    assert s.streaming and s.device_total <= 56 * GB and s.spine_why.startswith("as given (--spine")
    files = [converted_unit_bytes(k3, layer_unit(i), "int8") for i in s.streamed_layers]
    assert s.spine_bytes_per_token == sum(files) and s.stream_buffers == 2 * max(files)
    assert s.spine_bytes_per_token < 0.56 * sum(layer_table(k3, mac).stored[i] for i in s.streamed_layers)
    assert 25.0 * GB < s.expert_bytes_per_token <= 25.83 * GB  # 92 x 16 x 17.5 MB, a little cached


def test_an_h200_holds_the_bf16_spine_and_caches_experts(k3):
    s = choose(k3, 0, 93, Placement("cuda"), Budget(int(132 * GB), int(110 * GB)), SizingInput())
    assert s.spine == "bf16" and not s.streamed_layers and s.streaming and s.expert_cache > 2 * GB
    assert s.host < 5 * GB and s.device_total <= 132 * GB  # staging and the runtime live in host RAM


def test_every_expert_stays_resident_only_when_it_fits(tiny_dir):
    cfg = load_config(tiny_dir)
    s = choose(cfg, 0, cfg.num_layers, Placement("cpu"), Budget(8 * GB), SizingInput())
    assert s.experts_resident and s.spine == "bf16"
    # one byte less: every expert stays, the spine exact, with a shorter forward (resident experts are read by no
    # forward: a prompt's several forwards cost nothing more) ...
    tight = choose(cfg, 0, cfg.num_layers, Placement("cpu"), Budget(s.total - 1), SizingInput())
    assert tight.experts_resident and tight.spine == "bf16" and tight.forward_tokens < s.forward_tokens
    assert tight.total < s.total and tight.prompt_tokens == tight.forward_tokens  # nothing to lend
    # ... while at the forward it had, an int8 spine keeps every expert in memory (no disk reads at all beats
    # exact bf16) ...
    fixed = SizingInput(prefill_chunk=s.forward_tokens)
    int8 = choose(cfg, 0, cfg.num_layers, Placement("cpu"), Budget(s.total - 1), fixed)
    assert int8.experts_resident and int8.spine == "int8" and int8.total < s.total
    # ... and below that the experts stream
    streams = choose(cfg, 0, cfg.num_layers, Placement("cpu"), Budget(int8.total - 1), fixed)
    assert streams.streaming and streams.total <= int8.total - 1
    bf16 = choose(cfg, 0, cfg.num_layers, Placement("cpu"), Budget(s.total - 1),
                  SizingInput(spine="bf16", prefill_chunk=s.forward_tokens))
    assert bf16.streaming and bf16.spine == "bf16"


def test_most_resident_is_the_best_count(k3):
    """The scan agrees with a brute-force search over every resident count (memory is not monotonic in it)."""
    opts = SizingInput(spine="int8", prefill_chunk=512)  # a fixed forward: the residency is what is tested
    for budget in (20 * GB, 33 * GB, 47 * GB, 56 * GB):
        s = choose(k3, 0, 93, Placement("cpu"), Budget(budget), opts)
        fits = [k for k in range(94) if size_stage(k3, 0, 93, Placement("cpu"), "int8", 0, k, opts).total <= budget]
        assert len(s.resident_layers) == max(fits)


def test_the_forward_takes_the_planned_context_within_its_share_of_the_memory(k3):
    """With no --prefill-chunk a forward carries the planned context (a prompt up to it reads each expert once)
    when its workspace fits FORWARD_SHARE of the budget, else the most tokens that do; and the workspace grows
    with the forward's tokens by the rows' state and the routed experts' buffers, not by its attention, which
    runs a piece at a time."""
    from deltafin.models.pieces import PIECE_TOKENS
    from deltafin.plan.memory.forward_workspace import FORWARD_SHARE, auto_forward_tokens, workspace_bytes

    t = layer_table(k3, Placement("cpu"))
    big = choose(k3, 70, 93, Placement("cpu"), Budget(64 * GB), SizingInput(spine="int8", expert_layers=23))  # wide
    assert big.forward_tokens == 4096 and big.workspace <= FORWARD_SHARE * 64 * GB
    local = choose(k3, 70, 93, Placement("cpu"), Budget(64 * GB), SizingInput(spine="int8"))
    assert local.forward_tokens == PIECE_TOKENS and local.prompt_tokens == 4096  # its prompts borrow the cache
    share = auto_forward_tokens(k3, t, 70, 93, 4096, 24 * GB)
    assert PIECE_TOKENS < share < 4096
    assert workspace_bytes(k3, t, 70, 93, share, 4096, True) <= FORWARD_SHARE * 24 * GB < workspace_bytes(
        k3, t, 70, 93, share + 1, 4096, True)
    fixed = choose(k3, 70, 93, Placement("cpu"), Budget(64 * GB), SizingInput(spine="int8", prefill_chunk=512))
    assert fixed.forward_tokens == 512 and fixed.expert_cache > big.expert_cache and fixed.prompt_tokens == 512
    per_token = (workspace_bytes(k3, t, 70, 93, 2048, 4096, True) - workspace_bytes(k3, t, 70, 93, 1024, 4096, True))
    assert per_token / 1024 < 1.5e6  # ~1.3 MB a token at the last layers: every row's state, the experts' outputs


def test_a_small_wide_cache_gives_way_to_a_longer_forward(k3):
    """A wide store's cache (it serves others' calls too, so it is never lent) holding under FORWARD_SHARE of the
    experts it serves shrinks for a forward longer than the share allows, as long as the budget holds it, the
    spine kept as planned; a larger cache does not."""
    from deltafin.plan.memory.forward_workspace import FORWARD_SHARE, auto_forward_tokens
    from deltafin.plan.memory.sizing import size_stage
    from deltafin.plan.memory.stage_parts import expert_slot_bytes

    t, cpu = layer_table(k3, Placement("cpu")), Placement("cpu")
    wide = SizingInput(spine="int8", expert_layers=23, expert_share=0.5)
    served = 23 * k3.num_experts * expert_slot_bytes(k3) * 0.5
    for gb in (16, 24):
        share = auto_forward_tokens(k3, t, 70, 93, 4096, gb * GB)
        planned = choose(k3, 70, 93, cpu, Budget(gb * GB), replace(wide, prefill_chunk=share))
        assert 0 < planned.expert_cache < FORWARD_SHARE * served
        s = choose(k3, 70, 93, cpu, Budget(gb * GB), wide)
        assert s.forward_tokens > share and s.expert_cache < planned.expert_cache
        assert s.prompt_tokens == s.forward_tokens  # nothing lent
        assert (s.spine, s.resident_layers) == (planned.spine, planned.resident_layers)
        if s.forward_tokens < 4096:  # the longest that fits: one token more does not, even with no cache
            longer = size_stage(k3, 70, 93, cpu, "int8", 0, len(s.resident_layers),
                                replace(wide, prefill_chunk=s.forward_tokens + 1))
            assert not Budget(gb * GB).fits(longer) and s.expert_cache == 0
    long_context = replace(wide, context=16384)  # 64 GB: a cache over a tenth keeps its room
    share = auto_forward_tokens(k3, t, 70, 93, 16384, 64 * GB)
    s = choose(k3, 70, 93, cpu, Budget(64 * GB), long_context)
    assert s.expert_cache > FORWARD_SHARE * served and s.forward_tokens == share < 16384


def test_a_prompt_borrows_a_local_cache_for_longer_forwards(k3):
    """A stage that streams its own experts keeps one attention piece's forward beside its cache (decode steps, a
    short prompt), and a longer prompt's forward borrows the cache: `prompt_tokens` is the longest forward up to the
    context whose plan with no cache fits the budget (one token more does not), the rest of the plan unchanged; a
    forward size given keeps the cache through prompts."""
    from deltafin.models.pieces import PIECE_TOKENS
    from deltafin.plan.memory.sizing import lends, lent

    cpu, opts = Placement("cpu"), SizingInput(spine="int8")
    for gb in (18, 22):  # a small cache (the spine takes the rest), and a larger one
        s = choose(k3, 70, 93, cpu, Budget(gb * GB), opts)
        assert lends(k3, s) and s.forward_tokens == PIECE_TOKENS < s.prompt_tokens <= 4096
        fixed = choose(k3, 70, 93, cpu, Budget(gb * GB), replace(opts, prefill_chunk=PIECE_TOKENS))
        assert (fixed.expert_cache, fixed.prompt_tokens) == (s.expert_cache, PIECE_TOKENS)  # given: not lent
        borrowed = lent(k3, s, cpu, opts, s.prompt_tokens)
        assert Budget(gb * GB).fits(borrowed) and borrowed.expert_cache == 0
        assert (borrowed.sessions, borrowed.prefixes, borrowed.layers) == (s.sessions, s.prefixes, s.layers)
        assert borrowed.expert_staging == s.expert_staging  # the working slots stay
        if s.prompt_tokens < 4096:
            assert not Budget(gb * GB).fits(lent(k3, s, cpu, opts, s.prompt_tokens + 1))
    assert choose(k3, 70, 93, cpu, Budget(24 * GB), opts).prompt_tokens == 4096
    none = choose(k3, 70, 93, cpu, Budget(16 * GB), opts)  # the spine leaves no cache: nothing to lend
    assert none.expert_cache == 0 and not lends(k3, none) and none.prompt_tokens == none.forward_tokens


def test_more_memory_never_holds_less(k3):
    counts = [len(choose(k3, 0, 93, Placement("cpu"), Budget(g * GB), SizingInput(spine="int8")).resident_layers)
              for g in range(20, 80, 4)]
    assert counts == sorted(counts)


def test_refusal_names_the_numbers(k3):
    with pytest.raises(SizingError, match=r"layers 0-92 cannot fit on cpu: .* at least [\d.]+ GB .* is 8\.00 GB"):
        choose(k3, 0, 93, Placement("cpu"), Budget(8 * GB), SizingInput())


def test_sessions_are_sequences_at_context(k3):
    one = size_stage(k3, 0, 93, Placement("cpu"), "int8", 0, 0, SizingInput(sequences=1, context=4096)).sessions
    # 69 KDA layers x (conv window + 96x128x128 state) fp32, 24 MLA layers x 4096 x 576 fp32 (docs/PERF.md)
    assert one == 69 * (3 * 3 * 12288 + 96 * 128 * 128) * 4 + 24 * 4096 * 576 * 4
    four = size_stage(k3, 0, 93, Placement("cpu"), "int8", 0, 0, SizingInput(sequences=4, context=4096)).sessions
    assert four == 4 * one


# ---- planned == allocated -------------------------------------------------------------------------------


@pytest.mark.parametrize("device", [CPU, META], ids=["cpu", "discrete"])
@pytest.mark.parametrize("spine", ["bf16", "int8", "q4"])
@pytest.mark.parametrize("layout", ["resident", "streamed"])
def test_planned_equalsallocated(tiny_dir, device, spine, layout):
    """Every part the plan counts is what the stage holds: weights (to 1%: the plan counts AttnRes and A_log
    vectors as placed, exactly), buffers and expert slots (exactly), sessions at the planned length (exactly)."""
    cfg = load_config(tiny_dir)
    ckpt = open_checkpoint(tiny_dir, cfg)
    context = 40
    opts = StageOptions(sizing=SizingInput(spine=spine, sequences=2, context=context, read_threads=2,
                                             expert_cache_bytes=None if layout == "resident" else 3 * 10**5))
    if layout == "streamed":  # a budget under the whole stage's: the tail streams
        sizing = opts.sizing_for(ckpt.config, layer_spans(ckpt))
        totals = [size_stage(cfg, 0, 6, Placement(device.type), spine, 3 * 10**5, k, sizing).device_total
                  for k in range(7)]
        smaller = [t for t in totals if t < totals[-1]]
        assert smaller  # a converted spine streams its converted files: two of them take less than the layers
        opts = dataclasses.replace(opts, memory_bytes=max(smaller))
    stage = Stage(ckpt, 0, cfg.num_layers, device=device, options=opts)
    try:
        assert bool(stage.plan.streamed_layers) == (layout == "streamed")
        if device.type == "cpu":  # sessions at the planned length (a meta device computes nothing)
            for sid in ("a", "b"):
                stage.forward([SeqInput(sid, 0, ids=torch.arange(context) % 700)])
        planned, allocated = plan_of(stage), held(stage)
        assert abs(allocated["spine"] - planned["spine"]) <= 0.01 * planned["spine"]
        assert allocated["buffers"] <= planned["buffers"] and planned["buffers"] - allocated["buffers"] <= 2 * 8192
        assert allocated["experts"] == planned["experts"]
        if device.type == "cpu":
            assert allocated["sessions"] == planned["sessions"]
    finally:
        stage.close()


def test_expert_views_share_one_slot(tiny_dir):
    """Resident experts are views of one slab per layer (no per-expert allocation to round up)."""
    cfg = load_config(tiny_dir)
    experts = ResidentExperts(open_checkpoint(tiny_dir, cfg), [1], CPU)
    ptrs = {w.packed.untyped_storage().data_ptr() for _, e in experts.experts(1, list(range(cfg.num_experts)))
            for w in (e.w1, e.w2, e.w3) if isinstance(e, ExpertWeights)}
    assert len(ptrs) == 1


def test_max_resident_layers_streams_the_rest(k3):
    s = choose(k3, 0, 93, Placement("cpu"), Budget(200 * GB), SizingInput(spine="bf16", max_resident_layers=10))
    assert s.resident_layers == tuple(range(10)) and s.streamed_layers == tuple(range(10, 93)) and s.spine == "bf16"
    assert s.expert_cache > 50 * GB  # the memory the spine does not take caches experts


def test_a_budget_too_small_is_refused_before_loading(tiny_dir):
    """The command says what it needs and stops: one line, exit 1, no traceback, nothing loaded."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "deltafin", "-q", "bench", "--model", str(tiny_dir), "--memory-gb",
                        "0.5", "--no-disk"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: layers 0-5 cannot fit on cpu") and "the budget is 0.50 GB" in r.stderr


def test_a_resident_first_layer_can_be_what_makes_it_fit(k3):
    """Streaming layer 0 (the dense MLP, 1.2 GB as converted int8) needs two buffers its size and, on a Mac, two
    device copies; holding it resident takes one. So a budget can fit one resident layer and not zero: the search
    must not stop at zero."""
    mac = Placement("mps", experts="mlx")
    opts = SizingInput(spine="int8", sequences=1, prefill_chunk=512)
    sizes = [size_stage(k3, 0, 93, mac, "int8", 0, k, opts).total for k in (0, 1)]
    assert sizes[1] < sizes[0]
    s = choose(k3, 0, 93, mac, Budget((sizes[0] + sizes[1]) // 2), opts)
    assert len(s.resident_layers) == 1


def test_a_boundary_token_carries_its_banked_blocks(k3):
    """At K3's width a token entering layer 90 carries 8 banked AttnRes blocks and the partial one: 9 * 7168 * 4 B
    = 258,048 B in fp32, so a 16,384-token forward's state there is 4.2 GB, four 1 GiB messages: it goes in parts
    (tests/deltafin/transport/test_codec.py)."""
    from deltafin.plan.memory.stage_parts import boundary_bytes_per_token

    assert k3.blocks_entering(90) == 8
    assert boundary_bytes_per_token(k3, 90, 4) == 9 * 7168 * 4
    assert boundary_bytes_per_token(k3, 12, 2) == 2 * 7168 * 2  # early: one banked block (bf16)
    assert 16384 * boundary_bytes_per_token(k3, 90, 4) > 3.9 * (1 << 30)


# ---- wide experts ------------------------------------------------------------------------------------------


def test_a_wide_store_is_planned_as_allocated(tiny_dir, tmp_path):
    """A wide worker's store serves every MoE layer's share (its own stage's and others'), with a second layer of
    demand slots for the calls it serves and readers on each of its disks: exactly the slots the plan counts;
    a holder without layers likewise, within its budget."""
    import shutil

    from deltafin.runtime.assigned import holder_plan
    from deltafin.runtime.stage_build import disk_plan, open_experts

    cfg = load_config(tiny_dir)
    ckpt = open_checkpoint(tiny_dir, cfg)
    slot, k = expert_slot_bytes(cfg), cfg.experts_per_token
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    opts = StageOptions(expert_dir=(str(copy),), disk_gbps=(1.0, 2.0),
                        sizing=SizingOptions(read_threads=2, expert_cache_bytes=10 * slot))
    wide = {"expert_layers": len(cfg.moe_layers), "expert_share": 0.5}  # what the wide plan gives this worker
    stage = Stage(ckpt, 0, 2, device=CPU, options=opts, plan=disk_plan(ckpt, 0, 2, CPU, opts, "torch", wide),
                  serves=cfg.moe_layers)
    try:
        z = stage.plan
        assert z.expert_layers == len(cfg.moe_layers) and z.expert_calls > 0 and not z.experts_resident
        assert z.expert_staging == ((2 + 2) * k + 2 * 2) * slot  # 2 layers of guesses + 2 of demand, 2 x 2 readers
        assert held(stage)["experts"] == plan_of(stage)["experts"] == 10 * slot + z.expert_staging
        assert stage.experts.layers == set(cfg.moe_layers)  # others' layers too
    finally:
        stage.close()
    budget = StageOptions(memory_bytes=2 * GB, sizing=SizingOptions(read_threads=2))
    sizing = holder_plan(ckpt, CPU, budget, wide)
    assert sizing.holder_only and sizing.device_total <= 2 * GB and sizing.sessions == sizing.layers == 0
    # the cache never outgrows every expert it could be asked for
    assert sizing.expert_cache == len(cfg.moe_layers) * cfg.num_experts * slot
    store = open_experts(ckpt, sizing, budget, CPU, cfg.moe_layers, "torch")
    try:
        assert store.pool.nbytes == sizing.expert_cache + sizing.expert_staging == sizing.expert_cache + (
            3 * k + 2) * slot
    finally:
        store.close()


def test_wide_sizing_counts_the_calls_and_never_keeps_every_expert(k3):
    wide = SizingInput(spine="int8", expert_layers=len(k3.moe_layers), expert_share=0.25, prefill_chunk=512)
    z = choose(k3, 0, 23, Placement("mps"), Budget(56 * GB), wide)
    assert not z.experts_resident and z.expert_layers == 92 and z.device_total <= 56 * GB
    # both ways at 512 tokens: rows out and 16 outputs back per token, as messages and as tensors
    assert z.expert_calls == 2 * (2 * 512 * 17 * k3.expert_dim * 4)
    share_experts = 92 * k3.num_experts * 0.25
    held_fraction = min(1.0, z.expert_cache // expert_slot_bytes(k3) / share_experts)
    per_token = 92 * 16 * k3.bytes_per_expert
    assert z.expert_bytes_per_token == round(per_token * 0.25 * (1 - held_fraction))
    with pytest.raises(SizingError, match="never all resident"):
        size_stage(k3, 0, 2, Placement("cpu"), "int8", None, 2, wide)


def test_an_expert_mode_reads_its_share_and_the_plan_prices_it(k3):
    """One 64 GB Mac's plan in top-p:0.5 reads the mode's share of exact's expert bytes a token, and its token's
    disk time falls by as much (every expert read is a demand read there: the disk is the bottleneck)."""
    from deltafin.expert_modes import parse, read_share
    from deltafin.plan.cluster.cluster_plan import WorkerCapacity
    from deltafin.plan.cluster.links import Links
    from deltafin.plan.modes import choose_mode

    share = read_share(parse("top-p:0.5"))
    mac = Placement("mps", experts="mlx")
    exact = choose(k3, 0, 93, mac, Budget(56 * GB), SizingInput())
    mode = choose(k3, 0, 93, mac, Budget(56 * GB), SizingInput(expert_read_share=share))
    assert mode.expert_read_share == share and exact.expert_read_share == 1.0
    assert mode.expert_bytes_per_token == pytest.approx(exact.expert_bytes_per_token * share, rel=1e-6)
    macs = [WorkerCapacity("mac", 56 * GB, 5.0, ((0, k3.num_layers),), True, device="mps", worker_id="0")]
    plans = [choose_mode(k3, macs, SizingInput(expert_read_share=s), 4, "auto", Links()) for s in (1.0, share)]
    disk = [p.token.disk for p in plans]
    assert disk[1] == pytest.approx(disk[0] * share, rel=0.02)
