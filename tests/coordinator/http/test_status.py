"""`GET /v1/status`: the shaping against known counters, prefills and worker stats, and the route over a served
tiny engine, whose numbers must be /metrics' numbers; the web chat's files beside it (public, no-cache, 404 for
any other name)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import openai
import pytest

from deltafin.checkpoint.config import load_config
from deltafin.coordinator.cluster.backend import LocalBackend
from deltafin.coordinator.engine.engine import Counters, Prefilling
from deltafin.coordinator.engine.events import PrefillProgress
from deltafin.coordinator.engine.scheduler import SchedulerStats
from deltafin.coordinator.http.server import start
from deltafin.coordinator.http.status import status
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.worker_stats import StageStats, WideStats
from deltafin.text.tokenizer import K3Tokenizer
from deltafin.weights.expert_stats import ExpertStats

WIDE = StageStats(name="mac1", layers=(0, 47), tokens=9, sessions=1, spine_streamed_bytes=2_000,
                  experts=ExpertStats(bytes_read=5_000_000, lookups=100, hits=75),
                  wide=WideStats(share="0-447", own_expert_bytes=3_000_000))
RESIDENT = StageStats(name="local-0", layers=(0, 6), tokens=3)


def test_status_shapes_counters_prefills_and_workers() -> None:
    c = Counters(requests=3, prompt_tokens=40, generated_tokens=12, last_tokens_per_second=2.34567,
                 finished={"stop": 1, "length": 1}, cancelled=1)
    prefill = Prefilling(PrefillProgress(512, 4096, 1.2e9, 30e9), started=100.0)
    got = status("k3", 61.04, c, SchedulerStats(active=2, waiting=1), [prefill], [WIDE, RESIDENT], now=130.0)
    assert got["model"] == "k3" and got["uptime_s"] == 61.0 and got["workers_error"] is None
    assert got["counters"] == {"requests": 3, "prompt_tokens": 40, "generated_tokens": 12,
                               "last_tokens_per_second": 2.346, "finished": {"length": 1, "stop": 1},
                               "cancelled": 1, "failed": 0}
    assert got["queue"] == {"running": 2, "waiting": 1}
    # 1.2 GB in 30 s: the other 28.8 GB at 40 MB/s take 720 s
    assert got["prefilling"] == [{"tokens_done": 512, "tokens_total": 4096, "bytes_done": 1_200_000_000,
                                  "bytes_total": 30_000_000_000, "fraction": 0.04, "elapsed_s": 30.0,
                                  "seconds_left": 720.0}]
    assert got["workers"] == [
        {"name": "mac1", "layers": [0, 47], "experts": "0-447", "hit_rate": 0.75, "expert_bytes_read": 5_000_000,
         "spine_bytes_streamed": 2_000, "tokens": 9, "sessions": 1},
        {"name": "local-0", "layers": [0, 6], "experts": None, "hit_rate": None, "expert_bytes_read": 0,
         "spine_bytes_streamed": 0, "tokens": 3, "sessions": 0}]


def test_status_without_worker_stats_still_says_the_coordinators_own() -> None:
    fresh = Prefilling(PrefillProgress(0, 100, 0.0, 0.0), started=5.0)  # nothing read yet: no time left to say
    got = status("m", 1.0, Counters(), SchedulerStats(), [fresh], None, now=5.0, workers_error="timed out",
                 reconnecting={"w1": 2.345})  # recovery.py asks w1 again: its link dropped
    assert got["workers"] == [] and got["workers_error"] == "timed out" and got["reconnecting"] == {"w1": 2.3}
    assert got["prefilling"][0]["seconds_left"] is None and got["prefilling"][0]["fraction"] == 0.0


@pytest.fixture
async def served(tiny_dir: Path):
    from deltafin.coordinator.engine.engine import Engine

    engine = Engine(LocalBackend(LocalPipeline.load(tiny_dir, 1, "cpu", "fp32")), K3Tokenizer.load(tiny_dir),
                    load_config(tiny_dir), "tiny")
    runner, port = await start(engine, "127.0.0.1", 0, api_key="sk-status")
    yield engine, f"http://127.0.0.1:{port}"
    await runner.cleanup()
    await engine.close()


def _metrics(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


async def test_status_route_says_what_metrics_say(served) -> None:
    engine, url = served
    key = {"Authorization": "Bearer sk-status"}
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-status", max_retries=0, timeout=120)
    r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/status") as denied:
            assert denied.status == 401  # a /v1 route: the API key, as the others
        async with s.get(url + "/v1/status", headers=key) as got:
            assert got.status == 200
            body = await got.json()
        async with s.get(url + "/metrics", headers=key) as m:
            metrics = _metrics(await m.text())
    c = body["counters"]
    assert c["requests"] == 1 and c["generated_tokens"] == r.usage.completion_tokens == 6
    assert c["generated_tokens"] == metrics["deltafin_generated_tokens_total"]
    assert c["prompt_tokens"] == metrics["deltafin_prompt_tokens_total"] == r.usage.prompt_tokens
    assert c["finished"] == {"length": 1} and metrics['deltafin_generations_total{outcome="length"}'] == 1
    assert c["last_tokens_per_second"] == pytest.approx(metrics["deltafin_decode_tokens_per_second"], abs=1e-3)
    assert c["last_tokens_per_second"] > 0 and body["queue"] == {"running": 0, "waiting": 0}
    (worker,) = body["workers"]
    assert worker["name"] == "local-0" and worker["layers"] == [0, engine.cfg.num_layers]
    assert worker["tokens"] == metrics['deltafin_worker_tokens_total{worker="local-0"}'] > 0
    assert worker["hit_rate"] is None  # tiny's experts are resident: nothing streams
    assert body["model"] == "tiny" and body["prefilling"] == [] and body["uptime_s"] >= 0


@pytest.mark.parametrize("path,kind", [("/", "text/html"), ("/web/chat.js", "text/javascript"),
                                       ("/web/chat.css", "text/css")])
async def test_the_web_chat_is_served_without_the_key(served, path: str, kind: str) -> None:
    _, url = served
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        assert r.status == 200 and r.content_type == kind and r.headers["Cache-Control"] == "no-cache"
        text = await r.text()
    assert text.strip() and ("innerHTML" not in text if path.endswith(".js") else True)


@pytest.mark.parametrize("path", ["/web/index.html", "/web/nope.js", "/web/..%2Fserver.py", "/web/"])
async def test_unknown_web_files_are_404(served, path: str) -> None:
    _, url = served
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
