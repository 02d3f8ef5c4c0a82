"""Soak: many short requests (some cancelled mid-stream, some invalid) through the API and a real worker;
prints JSON with request counts and the worker's and coordinator's memory before and after.

    python -m tests.system.soak --model DIR [--requests 500] [--concurrency 4]

`tests/system/test_soak.py` runs a shorter soak and asserts that memory stays flat and no session is left.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import aiohttp

from tests.support.cluster import ServerProcess, http_get, rss_bytes, workers


async def _one(session: aiohttp.ClientSession, url: str, i: int, rng: random.Random) -> str:
    kind = ("ok", "ok", "ok", "ok", "chat_stream", "chat_stream", "cancel", "cancel", "invalid", "too_long")[i % 10]
    prompt = " ".join(rng.choice(["cache", "expert", "stage", "token", "Mac", "流", "🙂"]) for _ in range(6))
    if kind == "ok":
        body = {"model": "m", "prompt": prompt, "max_tokens": rng.randint(1, 6), "temperature": rng.random()}
        path = "/v1/completions"
    elif kind in ("chat_stream", "cancel"):
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 64 if kind ==
                "cancel" else 4, "stream": True, "reasoning_effort": "low", "extra": None}
        path = "/v1/chat/completions"
    elif kind == "invalid":
        body = {"model": "m", "prompt": prompt, "temperature": -3}
        path = "/v1/completions"
    else:
        body = {"model": "m", "prompt": prompt * 400, "max_tokens": 4}
        path = "/v1/completions"
    async with session.post(url + path, json=body) as r:
        if kind == "cancel":
            await r.content.readline()
            r.close()  # the client goes away mid-stream
            return "cancelled"
        await r.read()
        return f"{kind}:{r.status}"


async def soak(url: str, requests: int, concurrency: int, seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:
        async def run(i: int) -> None:
            async with sem:
                out = await _one(session, url, i, rng)
                outcomes[out] = outcomes.get(out, 0) + 1

        await asyncio.gather(*(run(i) for i in range(requests)))
    return outcomes


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = json.loads(http_get(url + "/health")[1])
        if all(w["sessions"] == 0 for w in health["workers"]) or time.monotonic() > deadline:
            return health
        time.sleep(0.2)


def run_soak(model: Path, requests: int, concurrency: int, warmup: int = 60) -> dict:
    with workers(model, 1) as (w,):
        server = ServerProcess(model, "--worker", w.address, serve_args=("--served-model-name", "m",
                                                                          "--max-context", "1024"))
        try:
            asyncio.run(soak(server.url, warmup, concurrency, seed=1))
            wait_idle(server.url)
            before = {"worker": rss_bytes(w.proc.pid), "coordinator": rss_bytes(server.proc.pid)}
            t0 = time.monotonic()
            outcomes = asyncio.run(soak(server.url, requests, concurrency, seed=2))
            seconds = time.monotonic() - t0
            health = wait_idle(server.url)
            after = {"worker": rss_bytes(w.proc.pid), "coordinator": rss_bytes(server.proc.pid)}
            alive = w.proc.poll() is None and server.proc.poll() is None
        finally:
            server.stop()
    return {"requests": requests, "warmup_requests": warmup, "concurrency": concurrency, "seconds": round(seconds, 1),
            "outcomes": outcomes, "sessions_left": sum(x["sessions"] for x in health["workers"]),
            "rss_before_mb": {k: round(v / 1e6, 1) for k, v in before.items()},
            "rss_after_mb": {k: round(v / 1e6, 1) for k, v in after.items()},
            "rss_growth_mb": {k: round((after[k] - before[k]) / 1e6, 1) for k in before},
            "processes_alive": alive}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=4)
    args = p.parse_args()
    print(json.dumps(run_soak(Path(args.model), args.requests, args.concurrency), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
