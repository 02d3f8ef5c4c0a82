"""`deltafin bench`'s decode and prefill JSON."""

from __future__ import annotations

from deltafin.checkpoint.config import load_config
from deltafin.plan.memory.sizing_options import SizingOptions
from deltafin.plan.memory.stage_parts import expert_slot_bytes
from deltafin.runtime.stage_options import StageOptions


def test_bench_decode_json_on_tiny(tiny_dir):
    from deltafin.cli.bench import bench_decode

    r = bench_decode(tiny_dir, tokens=3, prompt=2, device="cpu",
                     options=StageOptions(sizing=SizingOptions(expert_cache_bytes=100_000,
                                                               read_threads=2)), measure_disk=False)
    for key in ("tok_per_s", "s_per_token_median", "bytes_read_per_token", "read_GBps_achieved", "cache_hit_rate",
                "prefetch_recall", "io_wait_s_per_token", "compute_s_per_token", "t_compute_s", "policy_hit_rates",
                "plan_gb", "peak_rss_gb", "planned_gb"):
        assert key in r, key
    assert r["bytes_read_per_token"] > 0 and r["t_compute_s"] > 0 and r["experts_streamed"]
    assert r["bytes_read_per_token"] == r["expert_bytes_read_per_token"] + r["spine_bytes_per_token"]
    assert r["load_s"] > 0 and "warmed_experts" not in r  # no heat given: nothing warmed
    assert r["cache_experts"] == 100_000 // expert_slot_bytes(load_config(tiny_dir)) and r["prefill_hit_rate"] == 0


def test_bench_decode_in_a_mode_with_a_copy_reads_fewer_bytes(tiny_dir, tmp_path, monkeypatch):
    """A decode in q3 streams the copy (converted first, here into a folder of the test's) and reads fewer expert
    bytes a token than exact with the same cache; its t_compute replay reads the copy too."""
    from deltafin.cli.bench import bench_decode
    from deltafin.weights import expert_copy

    monkeypatch.setattr(expert_copy, "default_root", lambda model_dir, fmt: tmp_path / fmt)
    runs = {mode: bench_decode(tiny_dir, tokens=3, prompt=2, device="cpu", measure_disk=False,
                               options=StageOptions(expert_mode=mode, prefetch=False,
                                                    sizing=SizingOptions(expert_cache_bytes=0, read_threads=2)))
            for mode in ("exact", "q3")}
    assert (tmp_path / "q3" / "manifest.json").is_file() and runs["q3"]["t_compute_s"] > 0
    assert 0 < runs["q3"]["expert_bytes_read_per_token"] < runs["exact"]["expert_bytes_read_per_token"]


def test_bench_heat_reports_the_hit_rate_without_and_with_the_remembered_heat(small_dir, tmp_path, monkeypatch):
    """The first run starts with an empty cache, so its prompt hits nothing; the second warms its cache from the
    first's heat (in a folder of the benchmark's own: the user's cache directory is left alone) before timing."""
    from deltafin.cli.bench import bench_heat

    monkeypatch.setenv("DELTAFIN_CACHE", str(tmp_path / "cache"))
    cfg = load_config(small_dir)
    slots = 40
    r = bench_heat(small_dir, tokens=3, prompt=3, device="cpu", measure_disk=False,
                   options=StageOptions(sizing=SizingOptions(expert_cache_bytes=slots * expert_slot_bytes(cfg),
                                                             read_threads=2)))
    for key in ("hit_rate_cold", "hit_rate_warm", "prefill_hit_rate_cold", "prefill_hit_rate_warm", "warm_s"):
        assert key in r, key
    assert r["cache_experts"] == slots and r["cold"]["warmed_experts"] == 0 and r["warmed_experts"] == slots
    assert r["prefill_hit_rate_cold"] == 0 < r["prefill_hit_rate_warm"]
    assert r["cold"]["load_s"] > 0 and r["warm"]["load_s"] > 0
    assert not (tmp_path / "cache").exists()


def test_bench_prefill_reads_each_expert_once_per_forward(tiny_dir):
    """A prompt in one forward reads every expert of every MoE layer once (600 tokens touch all of tiny's); in
    forwards of 100 tokens, once per forward (each forward touches all of them again, and the cache holds none).
    Prefetch off: its guesses' bytes depend on how reads and compute interleave (the machine's load)."""
    from deltafin.checkpoint.config import load_config
    from deltafin.cli.bench import bench_prefill

    cfg = load_config(tiny_dir)
    every = len(cfg.moe_layers) * cfg.num_experts * cfg.bytes_per_expert  # the experts' bytes
    whole, chunked = (bench_prefill(tiny_dir, [600], device="cpu", measure_disk=False,
                                    options=StageOptions(prefetch=False, sizing=SizingOptions(
                                        expert_cache_bytes=1, read_threads=2, prefill_chunk=n))) for n in (600, 100))
    one, six = whole["lengths"]["600"], chunked["lengths"]["600"]
    assert (one["forwards"], six["forwards"]) == (1, 6)
    experts = len(cfg.moe_layers) * cfg.num_experts
    assert (one["expert_loads"], six["expert_loads"]) == (experts, 6 * experts)
    # bytes: each load reads the expert's blocks, whole 4 KiB pages of direct I/O (tiny's experts are smaller)
    assert one["expert_bytes"] >= every and six["expert_bytes"] == 6 * one["expert_bytes"]
    assert one["x_all_experts"] == round(one["expert_bytes"] / every, 3)
    assert one["peak_rss_gb"] > 0
