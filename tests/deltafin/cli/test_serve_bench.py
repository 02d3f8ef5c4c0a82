"""`deltafin-coordinator ... bench --concurrency`: tokens, batches and stage time counted, in process and over
a worker."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from deltafin.coordinator.engine.engine import Engine
from tests.support.cluster import COORDINATOR, workers


async def test_serving_bench_counts_tokens_batches_and_stage_time(local_engine: Engine) -> None:
    from deltafin.cli.serve_bench import bench_serving

    local_engine.scheduler.max_active = 3
    result = await bench_serving(local_engine, [1, 3], prompt_tokens=12, max_tokens=5)
    one, three = result["levels"]
    assert [one["tokens"], three["tokens"]] == [5, 15]  # stop tokens ignored: exactly max_tokens each
    assert one["sequences_per_batch"] == 1.0 and one["batches"] == 5  # the prompt's forward, then 4 steps
    assert three["sequences_per_batch"] > 1.5  # three streams share their decode steps' batches
    assert three["batches"] < 15
    for level in (one, three):
        (stage,) = level["stages"]
        assert stage["layers"] == [0, local_engine.cfg.num_layers]
        assert 0 < stage["busy_s"] <= level["wall_s"] * 1.01 and 0 < stage["utilization"] <= 1.01
        assert level["aggregate_tok_per_s"] == pytest.approx(level["tokens"] / level["wall_s"], rel=0.01)
    local_engine.scheduler.max_active = 4
    for ride in (True, False):
        local_engine.scheduler.ride = ride
        (level,) = (await bench_serving(local_engine, [2], prompt_tokens=8, max_tokens=6, long_prompt=40))["levels"]
        assert level["tokens"] == 12 and level["long_prompt_tokens"] == 40
        assert 0 < level["long_prompt_ttft_s"] < level["wall_s"]
    await local_engine.close()


def test_serving_bench_command_over_a_worker(tiny_dir: Path) -> None:
    with workers(tiny_dir, 1) as (w,):
        cluster = ["--model", str(tiny_dir), "--worker", w.address, "--no-discover", "-q"]
        done = subprocess.run([*COORDINATOR, *cluster, "bench", "--concurrency", "2", "--prompt-tokens", "8",
                               "--max-tokens", "3"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        (level,) = json.loads(done.stdout)["levels"]
        assert level["concurrency"] == 2 and level["tokens"] == 6
        assert level["stages"][0]["worker"] == "w0" and level["stages"][0]["busy_s"] > 0
        bad = subprocess.run([*COORDINATOR, *cluster, "bench", "--concurrency", "two"], capture_output=True,
                             text=True, timeout=300)
        assert bad.returncode != 0 and "--concurrency takes positive counts" in bad.stderr
        assert "Traceback" not in bad.stderr
