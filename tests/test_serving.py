"""Real processes: the API server over a worker equals `deltafin-coordinator generate`; `deltafin chat`;
`deltafin demo`."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import openai
import pytest
from cluster_util import workers

from deltafin.chat import ChatOptions, encode
from deltafin.config import load_config
from deltafin.coordinator.backend import LocalBackend
from deltafin.coordinator.chat_session import ChatSession
from deltafin.coordinator.engine import Engine
from deltafin.pipeline import LocalPipeline
from deltafin.sampling import SamplingParams
from deltafin.tokenizer import K3Tokenizer

PROMPT = "Pipeline parallelism buys memory and disk bandwidth"
COORDINATOR = [sys.executable, "-m", "deltafin.coordinator.main"]


def test_api_greedy_equals_generate_command(small_dir: Path) -> None:
    tok = K3Tokenizer.load(small_dir)
    with workers(small_dir, 1) as (w,):
        cluster = ["--model", str(small_dir), "--worker", w.address, "--no-discover", "-q"]
        done = subprocess.run([*COORDINATOR, *cluster, "generate", PROMPT, "--max-tokens", "12", "--json"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        expected = json.loads(done.stdout)
        server = subprocess.Popen([*COORDINATOR, *cluster, "serve", "--port", "0", "--served-model-name", "k3"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = server.stdout.readline()  # type: ignore[union-attr]
            m = re.search(r"serving (http://[\d.]+:\d+)", line)
            assert m, line + server.stderr.read()  # type: ignore[union-attr]
            client = openai.OpenAI(base_url=m.group(1) + "/v1", api_key="unused", max_retries=0, timeout=300)
            r = client.completions.create(model="k3", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0)
            assert r.choices[0].text == expected["text"]
            assert r.choices[0].finish_reason == expected["finish_reason"]
            assert r.usage.completion_tokens == len(expected["ids"])
            assert r.usage.prompt_tokens == len(expected["prompt_ids"])
            stop = {tok.specials["<|end_of_msg|>"], tok.specials["[EOS]"]}
            assert r.choices[0].logprobs.tokens == [tok.token_bytes(i).decode("utf-8", errors="replace")
                                                    for i in expected["ids"] if i not in stop]
            chat = client.chat.completions.create(model="k3", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, temperature=0)
            assert chat.usage.completion_tokens == 4
            # the next request extends the first one's prompt: it resumes from the state kept at its end
            assert r.usage.prompt_tokens_details.cached_tokens == 0
            more = client.completions.create(model="k3", prompt=PROMPT + " across four machines", max_tokens=2,
                                             temperature=0)
            cached = more.usage.prompt_tokens_details.cached_tokens
            assert len(expected["prompt_ids"]) - 1 <= cached < more.usage.prompt_tokens, (cached, more.usage)
            metrics = urllib.request.urlopen(m.group(1) + "/metrics", timeout=30).read().decode()
            assert re.search(r"^deltafin_prefix_hits_total 1(\.0)?$", metrics, re.M), metrics
            assert re.search(rf"^deltafin_prefix_tokens_saved_total {cached}(\.0)?$", metrics, re.M)
        finally:
            server.send_signal(signal.SIGTERM)
            assert server.wait(30) == 0


@pytest.fixture
def local_engine(tiny_dir: Path):
    pipe = LocalPipeline.load(tiny_dir, 1, "cpu", "fp32")
    engine = Engine(LocalBackend(pipe), K3Tokenizer.load(tiny_dir), load_config(tiny_dir), "tiny")
    yield engine


async def test_chat_session_keeps_the_conversation(local_engine: Engine) -> None:
    session = ChatSession(local_engine, SamplingParams(temperature=0.0), max_tokens=6, system="Be kind.",
                          thinking="off")
    try:
        first = await session.turn("hello")
        second = await session.turn("and again")
        messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hello"},
                    {"role": "assistant", "content": first.content}, {"role": "user", "content": "and again"}]
        assert second.prompt_ids == encode(local_engine.tokenizer, messages, ChatOptions(thinking=False))
        assert first.finished is not None and first.finished.usage.completion_tokens == 6
        session.reset()
        assert session.messages == [{"role": "system", "content": "Be kind."}]
    finally:
        await local_engine.close()


def test_chat_command(tiny_dir: Path) -> None:
    script = "hello\n/think low\n/bogus\nand again\n/exit\n"
    done = subprocess.run([sys.executable, "-m", "deltafin", "chat", "--model", str(tiny_dir), "--local",
                           "--temperature", "0", "--max-tokens", "5"], input=script, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("you> ") == 5
    assert done.stderr.count("[5 tokens") == 2
    assert "[thinking low]" in done.stderr and "unknown command '/bogus'" in done.stderr


def test_demo_runs_and_reuses_its_checkpoint(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "deltafin", "demo", "--preset", "tiny", "--cache-dir", str(tmp_path),
           "--max-tokens", "6"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "RANDOM WEIGHTS" in first.stderr and "writing a synthetic K3 checkpoint" in first.stderr
    assert "deltafin-worker on 127.0.0.1:" in first.stderr and "[6 tokens" in first.stderr
    assert first.stdout.startswith("user: ")
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "using the cached checkpoint" in again.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["synthetic-k3-tiny-seed0"]


async def test_serving_bench_counts_tokens_batches_and_stage_time(local_engine: Engine) -> None:
    from deltafin.coordinator.serve_bench import bench_serving

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
