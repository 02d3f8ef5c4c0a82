"""A restarted server answering a prompt whose prefix it saw before the restart, with the prefixes kept on the disk
(a fresh `--prefix-dir`) and without (`--prefix-disk-gb 0`): `deltafin-coordinator --local serve` answers a
PROMPT-token prompt, stops (SIGTERM), starts again on the same folder and answers the same prompt with NEW more
tokens. Prints one JSON object: per mode, each server's time to first token (streamed `/v1/completions`, greedy),
the cached tokens the API reported, and the text; and whether both modes gave the same text.

    python -m tests.system.restart_bench --model K3SLICE --prompt-tokens 1024 --new-tokens 64 --memlimit-gb 8 \\
        -- --spine int8

Everything after `--` goes to the coordinator. With --memlimit-gb each server runs under `../shared/tools/memlimit`
(page cache included, dropped first), so the experts really stream from the disk.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from deltafin.checkpoint.config import load_config
from tests.support.cluster import memlimit, restarted_servers, split_at_dashes, timed_stream


def complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion: its time to the first text, the text, the cached tokens reported."""
    out = timed_stream(url, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                       lambda choice: choice.get("text"))
    return {k: out[k] for k in ("ttft_s", "cached_tokens", "text")}


def one_mode(args: argparse.Namespace, disk: bool, extra: list[str], prompt: list[int], longer: list[int]) -> dict:
    """The prompt through a server, then the longer prompt through the server restarted on the same folder."""
    with tempfile.TemporaryDirectory(prefix="deltafin-restart-") as folder:
        prefixes = ["--prefix-dir", folder] if disk else ["--prefix-disk-gb", "0"]
        servers = restarted_servers(args.model, "--local", *prefixes, *extra, runs=2, wrap=memlimit(args.memlimit_gb))
        requests = (("before_restart", prompt), ("after_restart", longer))
        return {name: complete(server.url, ids, args.max_tokens)
                for (name, ids), server in zip(requests, servers, strict=True)}


def main(argv: list[str] | None = None) -> None:
    own, extra = split_at_dashes(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--memlimit-gb", type=float, default=None)
    args = p.parse_args(own)
    vocab = load_config(args.model).vocab_size - 256
    ids = torch.randint(0, vocab, (args.prompt_tokens + args.new_tokens,), generator=torch.Generator().manual_seed(0))
    prompt, longer = ids[:args.prompt_tokens].tolist(), ids.tolist()
    out: dict = {"model": str(args.model), "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                 "max_tokens": args.max_tokens, "coordinator_args": extra, "memlimit_gb": args.memlimit_gb}
    for mode in ("disk", "memory_only"):
        out[mode] = one_mode(args, mode == "disk", extra, prompt, longer)
    out["same_text"] = out["disk"]["after_restart"]["text"] == out["memory_only"]["after_restart"]["text"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
