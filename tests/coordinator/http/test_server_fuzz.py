"""Bad input to the HTTP API, by property-based tests: every request gets 200, 400 or 404 with an OpenAI
error body, never a 500, and leaves no session behind."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltafin.checkpoint.config import load_config
from deltafin.coordinator.cluster.backend import LocalBackend
from deltafin.coordinator.engine.engine import Engine, ServingOptions
from deltafin.coordinator.http.server import start
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.text.tokenizer import K3Tokenizer

# ---- the HTTP API -------------------------------------------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
                    | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)


MUTATIONS = {
    "model": st.sampled_from(["other", 3, None, ""]), "max_tokens": st.sampled_from([0, -1, "2", 10**12, 3]),
    "temperature": st.sampled_from([0.5, -1, 3e9, "hot", None]), "top_p": st.sampled_from([0.5, 0, 2, True]),
    "top_k": st.sampled_from([-1, 0, 5, 1.5]), "n": st.sampled_from([1, 2, "1"]),
    "stop": st.sampled_from(["x", ["a", "b"], [""], ["x"] * 20, 5]) | JSON,
    "logprobs": JSON, "top_logprobs": st.sampled_from([0, 5, 50, -1]) | JSON, "seed": JSON,
    "stream": st.sampled_from([True, "yes", None]), "logit_bias": st.sampled_from([{"1": 5}, {"x": 1}, {"1": 500}])
    | JSON, "tools": JSON, "tool_choice": st.sampled_from(["auto", "required", "none", {"function": {}}]) | JSON,
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "x"}]) | JSON,
    "reasoning_effort": st.sampled_from(["low", "none", "medium", 1]), "stream_options": JSON,
    "messages": st.sampled_from([[], "hi", [{"role": 1}], [{"role": "user", "content": ["x", {"type": "video"}]}],
                                 [{"role": "tool", "content": "orphan"}], [{"role": "user", "content": "x" * 400}],
                                 [{"role": "user", "content": None}]]) | JSON,
    "prompt": st.sampled_from(["", [], [1, 2], [[1], [2]], [10**9], "ok", ["a", "b"]]) | JSON,
}


@st.composite
def api_requests(draw) -> tuple[str, dict]:
    """A valid request with a few fields replaced by odd or hostile values."""
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    for name in draw(st.lists(st.sampled_from(sorted(MUTATIONS)), max_size=3, unique=True)):
        body[name] = draw(MUTATIONS[name])
    return path, body


@pytest.fixture(scope="module")
def api_url(tiny_dir: Path):
    """An API server on its own event loop thread (hypothesis drives it synchronously)."""
    import asyncio

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    pipe = LocalPipeline.load(tiny_dir, 1, "cpu", "fp32")

    async def up():
        engine = Engine(LocalBackend(pipe), K3Tokenizer.load(tiny_dir), load_config(tiny_dir), "tiny",
                        ServingOptions(max_context=256))
        runner, port = await start(engine, "127.0.0.1", 0)
        return engine, runner, port

    engine, runner, port = asyncio.run_coroutine_threadsafe(up(), loop).result(60)
    yield f"http://127.0.0.1:{port}"

    async def down():
        await runner.cleanup()
        await engine.close()

    asyncio.run_coroutine_threadsafe(down(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)


def _post(url: str, body: object) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_api_fuzz_never_500(api_url: str) -> None:
    statuses: dict[int, int] = {}

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
    @given(api_requests())
    def fuzz(request: tuple[str, dict]) -> None:
        path, body = request
        code, text = _post(api_url + path, body)
        statuses[code] = statuses.get(code, 0) + 1
        assert code in (200, 400, 404), (code, body, text)
        if code != 200:
            error = json.loads(text)["error"]
            assert error["message"] and error["type"]

    fuzz()
    code, text = _post(api_url + "/v1/completions", {"model": "tiny", "prompt": "ok", "max_tokens": 1})
    assert code == 200
    health = json.loads(urllib_get(api_url + "/health"))
    assert health["workers"][0]["sessions"] == 0
    print(f"\nfuzzed API requests: {sum(statuses.values())}, statuses {statuses}")


def urllib_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()
