"""`deltafin bench`'s decode JSON."""

from __future__ import annotations

from deltafin.stage import StageOptions


def test_bench_decode_json_on_tiny(tiny_dir):
    from deltafin.bench import bench_decode

    r = bench_decode(tiny_dir, tokens=3, prompt=2, device="cpu",
                     options=StageOptions(expert_cache_bytes=100_000, read_threads=2), measure_disk=False)
    for key in ("tok_per_s", "s_per_token_median", "bytes_read_per_token", "read_GBps_achieved", "cache_hit_rate",
                "prefetch_recall", "io_wait_s_per_token", "compute_s_per_token", "t_compute_s", "policy_hit_rates",
                "plan_gb", "peak_rss_gb", "planned_gb"):
        assert key in r, key
    assert r["bytes_read_per_token"] > 0 and r["t_compute_s"] > 0 and r["experts_streamed"]
    assert r["bytes_read_per_token"] == r["expert_bytes_read_per_token"] + r["spine_bytes_per_token"]
