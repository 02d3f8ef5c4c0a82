"""`deltafin-coordinator`'s command line: options before or after the command, errors as one line, and the
API server over a worker gives what `generate` gives."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import urllib.request
from pathlib import Path

import openai
import pytest

from deltafin.text.tokenizer import K3Tokenizer
from tests.support.cluster import COORDINATOR, workers

PROMPT = "Pipeline parallelism buys memory and disk bandwidth"




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
            # the worker kept the `generate` command's prompt (with its last logits): this new coordinator finds
            # it there and resumes the whole prompt, feeding none of it; the same text
            assert r.usage.prompt_tokens_details.cached_tokens == len(expected["prompt_ids"])
            # the next request extends the first one's prompt: it resumes from the state kept at its end
            more = client.completions.create(model="k3", prompt=PROMPT + " across four machines", max_tokens=2,
                                             temperature=0)
            cached = more.usage.prompt_tokens_details.cached_tokens
            assert len(expected["prompt_ids"]) - 1 <= cached < more.usage.prompt_tokens, (cached, more.usage)
            metrics = urllib.request.urlopen(m.group(1) + "/metrics", timeout=30).read().decode()
            assert re.search(r"^deltafin_prefix_hits_total 2(\.0)?$", metrics, re.M), metrics
            saved = len(expected["prompt_ids"]) + cached
            assert re.search(rf"^deltafin_prefix_tokens_saved_total {saved}(\.0)?$", metrics, re.M)
        finally:
            server.send_signal(signal.SIGTERM)
            assert server.wait(30) == 0


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*COORDINATOR, *args], capture_output=True, text=True, timeout=300)


def test_cluster_options_go_before_or_after_the_command(tiny_dir: Path) -> None:
    before = _run("--model", str(tiny_dir), "--local", "-q", "generate", "hi", "--max-tokens", "3", "--json")
    after = _run("generate", "hi", "--max-tokens", "3", "--json", "--model", str(tiny_dir), "--local", "-q")
    assert before.returncode == after.returncode == 0, before.stderr + after.stderr
    assert json.loads(before.stdout)["ids"] == json.loads(after.stdout)["ids"]
    # given on both sides, the one after the command wins
    mixed = _run("--model", "/nonexistent", "generate", "hi", "--max-tokens", "1", "--model", str(tiny_dir),
                 "--local", "-q")
    assert mixed.returncode == 0, mixed.stderr
    missing = _run("generate", "hi", "--local")
    assert missing.returncode == 2 and "--model" in missing.stderr and "Traceback" not in missing.stderr


def test_plan_with_local_prints_the_plan_the_load_runs(tiny_dir: Path) -> None:
    """`--local plan` once answered "no workers"; it prints each in-process stage's plan without loading, the
    same plan `generate` then loads (its log line for the stage)."""
    plan = _run("--model", str(tiny_dir), "--local", "--local-stages", "2", "--memory-gb", "3", "--sequences", "2",
                "plan")
    assert plan.returncode == 0, plan.stderr
    *lines, mode = plan.stdout.strip().splitlines()
    assert [line.split(" on ")[0] for line in lines] == ["layers 0-2", "layers 3-5"]
    assert mode.startswith("expert mode exact:")
    # one context for both stages (a request goes through both): the longest the smaller room holds
    contexts = {line.split("2 sequence(s) of ")[1].split(" tokens")[0] for line in lines}
    assert len(contexts) == 1 and int(contexts.pop().replace(",", "")) > 4096, lines
    loaded = _run("--model", str(tiny_dir), "--local", "--local-stages", "2", "--memory-gb", "3", "--sequences", "2",
                  "-v", "generate", "hi", "--max-tokens", "1")
    assert loaded.returncode == 0, loaded.stderr
    for line in lines:
        layers = line.split(" on ")[0].removeprefix("layers ").split("-")
        memory = line.split("; ", 2)[2]  # "1.15 GB: layers ..., ...; spine ...": the stage's sizing
        assert f"stage [{layers[0]}, {int(layers[1]) + 1}) on cpu: {memory}" in loaded.stderr, (line, loaded.stderr)


def test_local_plan_refuses_a_budget_it_cannot_fit_with_the_least_that_plans(tiny_dir: Path) -> None:
    """`--local plan` in a budget too small exits 1 with one line: the least the stage needs (not "more workers",
    which an in-process stage cannot use); that much, as printed, plans."""
    small = _run("--model", str(tiny_dir), "--local", "--memory-gb", "0.3", "-q", "plan")
    assert small.returncode == 1 and "Traceback" not in small.stderr and not small.stdout
    (line,) = small.stderr.strip().splitlines()
    m = re.fullmatch(r"error: layers 0-5 cannot fit on cpu: they need at least ([\d.]+) GB \(.*\), and the budget is "
                     r"0.30 GB\. Give it more memory, or ask for fewer or shorter sequences", line)
    assert m, line
    least = _run("--model", str(tiny_dir), "--local", "--memory-gb", m.group(1), "-q", "plan")
    assert least.returncode == 0 and least.stdout.startswith("layers 0-5 on cpu"), least.stderr


def _serving(*args: str, serve: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    server = subprocess.Popen([*COORDINATOR, *args, "serve", "--port", "0", *serve], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    line = server.stdout.readline()  # type: ignore[union-attr]
    m = re.search(r"serving (http://[\d.]+:\d+)", line)
    assert m, line + server.stderr.read()  # type: ignore[union-attr]
    return server, m.group(1)


@pytest.mark.slow
def test_sigint_ends_a_running_stream_within_the_grace_and_a_second_exits_at_once(tiny_dir: Path) -> None:
    """SIGINT while a long stream runs: the server takes no new connection, the stream gets --shutdown-grace (1 s)
    to finish, then ends with an error event its client reads (code server_shutting_down, after the tokens it
    had), and the process exits 0 within seconds, not after the stream's thousands of tokens. A second SIGINT
    during a long grace ends the process at once (status 130)."""
    import time

    for second_signal in (False, True):
        grace = "60" if second_signal else "1"
        server, url = _serving("--model", str(tiny_dir), "--local", "-q", serve=("--shutdown-grace", grace))
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4000, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            chunks = iter(stream)
            got = [next(chunks).choices[0].text for _ in range(3)]
            t0 = time.monotonic()
            server.send_signal(signal.SIGINT)
            if second_signal:
                time.sleep(1.0)
                server.send_signal(signal.SIGINT)
                assert server.wait(10) == 130 and time.monotonic() - t0 < 10
                continue
            try:
                for chunk in chunks:
                    got.append(chunk.choices[0].text)
                raise AssertionError("the stream ended without the shutdown's error event")
            except openai.APIError as e:
                assert "shutting down" in str(e.message)
            assert 3 < len(got) < 4000
            assert server.wait(30) == 0 and time.monotonic() - t0 < 20
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                raise AssertionError("a stopped server answered")
            except OSError:
                pass
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
