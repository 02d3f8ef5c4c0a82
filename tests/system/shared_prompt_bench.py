"""A shared system prompt, a retried request and a restart, through `deltafin-coordinator --local serve` and the
OpenAI chat completions route (greedy): conversation A (a system prompt of WORDS words + "Hello"), conversation B
(the same system prompt + another question), A again; then the server restarts (SIGTERM) on the same prefix
folder and answers B and A again. The same five requests through a server that keeps no prefixes
(`--prefix-cache-gb 0`) give the reference text and times. Prints one JSON object: per request, its prompt tokens,
the cached tokens the API reported, its time to the first streamed token, the expert bytes the stages read for it
(from /metrics) and its text; and whether every text equals the reference's.

    python -m tests.system.shared_prompt_bench --model K3SLICE --system-words 1500 --memlimit-gb 8 -- --spine int8

Everything after `--` goes to the coordinator. With --memlimit-gb each server runs under `../shared/tools/memlimit`
(page cache included, dropped first), so the experts really stream from the disk.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

from tests.support.cluster import memlimit, restarted_servers, split_at_dashes, timed_stream

QUESTIONS = {"A": "Hello", "B": "Tell me about rivers"}
ORDER = (("A", 0), ("B", 0), ("A", 0), ("B", 1), ("A", 1))  # (conversation, server run): a restart before run 1


def system_prompt(words: int) -> str:
    """A system prompt of `words` plain words."""
    vocabulary = ["You", "are", "a", "careful", "assistant", "for", "a", "library", "of", "Python", "code", ".",
                  "Answer", "in", "one", "line"]
    return " ".join(vocabulary[i % len(vocabulary)] for i in range(words))


def expert_bytes(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("deltafin_worker_expert_bytes_read_total{"))


def _delta_text(choice: dict) -> str | None:
    delta = choice.get("delta", {})
    return delta.get("reasoning_content") or delta.get("content")


def chat(url: str, system: str, question: str, max_tokens: int) -> dict:
    """One streamed greedy chat completion: prompt and cached tokens, time to the first token, expert bytes read."""
    before = expert_bytes(url)
    body = {"max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    out = timed_stream(url, "/v1/chat/completions", body, _delta_text)
    return {"prompt_tokens": out["prompt_tokens"], "cached_tokens": out["cached_tokens"], "ttft_s": out["ttft_s"],
            "expert_GB_read": round((expert_bytes(url) - before) / 1e9, 3), "text": out["text"]}


def run(args: argparse.Namespace, extra: list[str], cache: bool) -> list[dict]:
    system = system_prompt(args.system_words)
    out: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="deltafin-shared-") as folder:
        prefixes = ["--prefix-dir", folder] if cache else ["--prefix-cache-gb", "0"]
        servers = restarted_servers(args.model, "--local", *prefixes, *extra, runs=2, wrap=memlimit(args.memlimit_gb))
        for server_run, server in enumerate(servers):
            for name, at in ORDER:
                if at == server_run:
                    out.append({"request": name, "after_restart": bool(at),
                                **chat(server.url, system, QUESTIONS[name], args.max_tokens)})
    return out


def main(argv: list[str] | None = None) -> None:
    own, extra = split_at_dashes(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--system-words", type=int, default=1300)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--memlimit-gb", type=float, default=None)
    args = p.parse_args(own)
    cached, reference = run(args, extra, cache=True), run(args, extra, cache=False)
    print(json.dumps({"model": str(args.model), "system_words": args.system_words, "coordinator_args": extra,
                      "memlimit_gb": args.memlimit_gb, "with_cache": cached, "without_cache": reference,
                      "same_text": [a["text"] for a in cached] == [b["text"] for b in reference]}, indent=1))


if __name__ == "__main__":
    main()
