"""Worker loss with real processes: kill -9 and SIGSTOP mid-stream, restart and rejoin, total loss.

The coordinator serves the API over two workers of `small`; every interrupted completion must equal
the uninterrupted greedy one token for token. The largest gap between streamed tokens around a fault
is the recovery time the client sees (printed; run with -s to read it).
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.support.cluster import ServerProcess, WorkerProcess, http_get, workers
from tests.support.links import slow_links

PROMPT = "Workers come and go"
N = 24


def _stream(url: str, fault=None, at: int = 6) -> tuple[list[str], str, float]:
    """(token strings, text, largest gap between tokens) of a greedy stream; `fault()` runs after `at`."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    stream = client.completions.create(model="small", prompt=PROMPT, max_tokens=N, temperature=0, logprobs=0,
                                       stream=True, extra_body={"ignore_eos": True})
    tokens, text, stamps = [], [], []
    for chunk in stream:
        for ch in chunk.choices:
            text.append(ch.text)
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                stamps.append(time.monotonic())
                if fault is not None and len(tokens) == at:
                    fault()
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return tokens, "".join(text), max(gaps, default=0.0)


def _health(url: str) -> tuple[int, dict]:
    code, body = http_get(url + "/health")
    return code, json.loads(body)


def _wait_for_workers(url: str, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code, body = _health(url)
        if code == 200 and len(body["workers"]) == n:
            return
        time.sleep(0.5)
    raise AssertionError(f"the cluster did not get back to {n} workers: {body}")


def _metric(url: str, name: str) -> float:
    for line in http_get(url + "/metrics")[1].splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(name)


def test_kill_stop_restart_rejoin(small_dir: Path) -> None:
    with workers(small_dir, 2) as (w0, w1):
        port1 = w1.address.rsplit(":", 1)[1]
        restarted: list[WorkerProcess] = []
        server = ServerProcess(small_dir, "--worker", w0.address, "--worker", w1.address, "--worker-timeout", "3",
                               "--rejoin-interval", "1", "--reconnect-timeout", "2",
                               serve_args=("--served-model-name", "small"))
        try:
            ref_tokens, ref_text, _ = _stream(server.url)
            assert len(ref_tokens) == N

            # kill -9 the second stage mid-stream: same completion, a delay at most
            tokens, text, gap_kill = _stream(server.url, lambda: w1.proc.send_signal(signal.SIGKILL))
            assert (tokens, text) == (ref_tokens, ref_text)
            w1.proc.wait()
            assert [w["name"] for w in _health(server.url)[1]["workers"]] == ["w0"]

            # restart it on the same address: it rejoins while the cluster is idle
            back = WorkerProcess(small_dir, "w1", "--port", port1)
            restarted.append(back)
            back.wait_ready()
            t0 = time.monotonic()
            _wait_for_workers(server.url, 2)
            rejoin_s = time.monotonic() - t0
            assert _stream(server.url)[:2] == (ref_tokens, ref_text)

            # freeze it mid-stream: the liveness probes give up after --worker-timeout, the cluster re-plans
            tokens, text, gap_stop = _stream(server.url, lambda: back.proc.send_signal(signal.SIGSTOP))
            assert (tokens, text) == (ref_tokens, ref_text)
            back.proc.send_signal(signal.SIGCONT)  # thawed, it is a spare and rejoins
            _wait_for_workers(server.url, 2)
            assert _stream(server.url)[:2] == (ref_tokens, ref_text)
            assert _metric(server.url, "deltafin_cluster_recoveries_total") >= 2
            print(f"\nrecovery seen by the client: kill -9 {gap_kill:.2f}s, SIGSTOP {gap_stop:.2f}s "
                  f"(--worker-timeout 3); rejoin after restart {rejoin_s:.2f}s")
            assert gap_kill < 30 and gap_stop < 30
        finally:
            for w in restarted:
                w.stop()
            assert server.stop() == 0


@pytest.mark.parametrize("down_s", [1.5, 4.0])
def test_a_link_that_drops_for_seconds_is_waited_for_not_planned_around(small_dir: Path, down_s: float) -> None:
    """The second worker reached through a link that drops mid-stream for `down_s` seconds (its proxy killed, then
    listening again on the same port): the coordinator asks it again rather than planning without it, the plan
    stays (both workers, the same stages: no replay), and the completion is the uninterrupted one."""
    with workers(small_dir, 2) as (w0, w1), slow_links([w1.address], rtt_ms=0.2, mbps=0) as link:
        server = ServerProcess(small_dir, "--worker", w0.address, "--worker", link.addresses[0], "--experts", "local",
                               "--worker-timeout", "3", serve_args=("--served-model-name", "small"))
        back: list[threading.Thread] = []
        try:
            ref_tokens, ref_text, _ = _stream(server.url)
            tokens, text, gap = _stream(server.url, lambda: back.append(link.drop(0, down_s)))
            back[0].join()
            assert (tokens, text) == (ref_tokens, ref_text)
            assert [w["name"] for w in _health(server.url)[1]["workers"]] == ["w0", "w1"]
            log = server.log()
            assert "w1 answers again after" in log and "same stages" in log and "new plan" not in log, log
            print(f"\na link down for {down_s:.1f}s: the longest gap between tokens {gap:.2f}s")
            assert gap < down_s + 10
        finally:
            assert server.stop() == 0


def test_losing_every_worker_fails_clearly_and_the_server_recovers(tiny_dir: Path) -> None:
    with workers(tiny_dir, 1) as (w0,):
        port = w0.address.rsplit(":", 1)[1]
        server = ServerProcess(tiny_dir, "--worker", w0.address, "--worker-timeout", "2", "--rejoin-interval", "1",
                               "--reconnect-timeout", "1", serve_args=("--served-model-name", "tiny"))
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            ok = client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0)
            w0.stop(signal.SIGKILL)
            try:
                client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0)
                raise AssertionError("expected a 503")
            except openai.InternalServerError as e:
                assert e.status_code == 503
                assert e.body["code"] == "cluster_unavailable"  # type: ignore[index]
                assert "no worker answers" in e.body["message"]  # type: ignore[index]
            assert _health(server.url)[0] == 503
            assert http_get(server.url + "/v1/models")[0] == 200  # still serving
            again = WorkerProcess(tiny_dir, "w0", "--port", port)
            try:
                again.wait_ready()
                r = client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0)
                assert r.choices[0].text == ok.choices[0].text
            finally:
                again.stop()
        finally:
            assert server.stop() == 0


def test_a_lost_expert_holder_moves_its_experts(small_dir: Path, tmp_path: Path) -> None:
    """Wide experts over two stages and a third worker that only holds experts: kill -9 of that holder mid-stream
    moves its experts to the stages (said in the log), SIGSTOP is caught by the probes within --worker-timeout,
    a restarted holder rejoins; every completion equals the uninterrupted one."""
    from tests.coordinator.cluster.test_workers_wide import without_top

    holder_dir = without_top(small_dir, tmp_path / "no-top")
    with workers(small_dir, 2) as (w0, w1):
        holder = WorkerProcess(holder_dir, "holder")
        holder.wait_ready()
        port = holder.address.rsplit(":", 1)[1]
        restarted: list[WorkerProcess] = [holder]
        server = ServerProcess(small_dir, "--worker", w0.address, "--worker", w1.address, "--worker",
                               holder.address, "--worker-timeout", "3", "--rejoin-interval", "1",
                               "--reconnect-timeout", "2", "--experts", "wide",
                               serve_args=("--served-model-name", "small"))
        try:
            _wait_for_workers(server.url, 3)
            assert any("experts" in w for w in _health(server.url)[1]["workers"])
            ref_tokens, ref_text, _ = _stream(server.url)

            tokens, text, gap_kill = _stream(server.url, lambda: holder.proc.send_signal(signal.SIGKILL))
            assert (tokens, text) == (ref_tokens, ref_text)
            holder.proc.wait()
            assert [w["name"] for w in _health(server.url)[1]["workers"]] == ["w0", "w1"]

            back = WorkerProcess(holder_dir, "holder", "--port", port)
            restarted.append(back)
            back.wait_ready()
            _wait_for_workers(server.url, 3)
            assert _stream(server.url)[:2] == (ref_tokens, ref_text)

            tokens, text, gap_stop = _stream(server.url, lambda: back.proc.send_signal(signal.SIGSTOP))
            assert (tokens, text) == (ref_tokens, ref_text)
            back.proc.send_signal(signal.SIGCONT)
            _wait_for_workers(server.url, 3)
            print(f"\nlost expert holder seen by the client: kill -9 {gap_kill:.2f}s, SIGSTOP {gap_stop:.2f}s "
                  "(--worker-timeout 3)")
            assert gap_kill < 30 and gap_stop < 30
        finally:
            for w in restarted:
                w.stop()
            assert server.stop() == 0
        log = server.log()
    assert re.search(r"holder's experts \(16/48x7\) moved to w[01]", log), log[-3000:]
    assert "same stages; retrying the step" in log, log[-3000:]  # the stages kept their sessions: no replay
    assert "| holder experts" in log, log[-3000:]  # it rejoined as an expert holder
