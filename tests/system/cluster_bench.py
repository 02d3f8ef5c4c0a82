"""A cluster of simulated Macs on this machine: one worker process per Mac, each under its own disk-read cap
(`../shared/tools/disklimit RATE`: its own SSD) and memory cap (`memlimit`: its own RAM, page cache included),
then the coordinator's `generate --json` (single stream) and, optionally, `bench --concurrency` (serving) over
them, for each worker count and expert placement asked, with each worker's stage load time. Prints one JSON
object.

    python -m tests.system.cluster_bench --model K3SLICE --workers 1,2,4 --experts wide,local \\
        --disk-rate 250M --memory-gb 5 --memlimit-gb 5.5 -- --spine int8 --expert-cache-gb 0.5 --sequences 1 \\
        --context 1024 --prefill-chunk 128

Everything after `--` goes to every coordinator command (sizing flags: the plan's budgets travel to the workers).
Without the tools (not root, no cgroup v1) the workers run uncapped and the output says so.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from deltafin.checkpoint.config import load_config
from tests.support.cluster import COORDINATOR, TOOLS, WorkerProcess, split_at_dashes


def _caps(rate: str, memlimit_gb: float) -> tuple[str, ...]:
    memlimit, disklimit = TOOLS / "memlimit", TOOLS / "disklimit"
    if not (memlimit.exists() and disklimit.exists()) or shutil.which("bash") is None:
        return ()
    return (str(memlimit), f"{int(memlimit_gb * 1024)}M", "--drop-caches", "--", str(disklimit), rate, "--")


def _coordinator(model: Path, addresses: list[str], experts: str, extra: list[str], *command: str) -> dict:
    workers = [a for address in addresses for a in ("--worker", address)]
    r = subprocess.run([*COORDINATOR, "--model", str(model), "--no-discover", *workers, "--experts", experts, *extra,
                        *command], capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"coordinator failed: {r.stderr[-3000:]}")
    out = r.stdout[r.stdout.index("{"):]
    return {**json.loads(out), "plan": [line for line in r.stderr.splitlines() if line.startswith(("w", "total"))]}


def decode_summary(cfg, generate: dict) -> dict:
    """Per decoded token: the time, its expert-bound part (the time less the stages' other compute, which runs
    one stage after another), and each worker's share of the routed experts' bytes."""
    tokens = max(1, generate["completion_tokens"] - 1)  # decode_workers start after the first token
    routed = len(cfg.moe_layers) * cfg.experts_per_token * cfg.bytes_per_expert
    rows = generate["decode_workers"]
    other = sum(r.get("forward_s", 0) - r.get("experts_s", 0) for r in rows) / tokens
    share = {r["name"]: round(r.get("bytes_read", 0) / tokens / routed, 3) for r in rows}  # off its disk
    per_token = generate["s_per_token"]
    return {"s_per_token": round(per_token, 3), "expert_part_s": round(per_token - other, 3),
            "routed_GB_per_token": round(routed / 1e9, 3), "read_fraction_of_routed": share,
            "hit_rate": generate["hit_rate"]}


def stage_load_seconds(log: str) -> float | None:
    """How long the worker's stage took to load (its log's "stage [a, b) loaded in S s" line)."""
    found = re.findall(r"stage \[\d+, \d+\) loaded in ([\d.]+)s", log)
    return float(found[-1]) if found else None


def run(model: Path, n: int, experts: str, args: argparse.Namespace) -> dict:
    prefix = _caps(args.disk_rate, args.memlimit_gb)
    gbps = str(float(args.disk_rate.rstrip("MmGg")) / (1000 if args.disk_rate[-1] in "Mm" else 1))
    procs = [WorkerProcess(model, f"w{i}", "--disk-gbps", gbps, memory_gb=args.memory_gb, prefix=prefix)
             for i in range(n)]
    try:
        addresses = [p.wait_ready(timeout=600) for p in procs]
        result = {"workers": n, "experts": experts, "capped": bool(prefix)}
        result["generate"] = _coordinator(model, addresses, experts, args.extra, "generate", args.prompt,
                                          "--max-tokens", str(args.tokens), "--json")
        result["decode"] = decode_summary(load_config(model), result["generate"])
        result["stage_load_s"] = {p.name: stage_load_seconds(p.log()) for p in procs}
        if args.concurrency:
            result["bench"] = _coordinator(model, addresses, experts, args.extra, "bench", "--concurrency",
                                           args.concurrency, "--prompt-tokens", "8", "--max-tokens",
                                           str(args.bench_tokens))
        return result
    finally:
        for p in procs:
            p.stop()


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_at_dashes(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(prog="python -m tests.system.cluster_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--workers", default="1,2,4", help="worker counts (default 1,2,4)")
    p.add_argument("--experts", default="wide,local", help="placements to run for more than one worker")
    p.add_argument("--disk-rate", default="250M", help="each worker's disk read cap (default 250M)")
    p.add_argument("--memory-gb", type=float, default=5.0, help="each worker's --memory-gb (default 5)")
    p.add_argument("--memlimit-gb", type=float, default=5.5, help="each worker's memory cap, page cache included")
    p.add_argument("--prompt", default="The disks of every Mac", help="the generate prompt")
    p.add_argument("--tokens", type=int, default=16, help="tokens to generate (default 16)")
    p.add_argument("--concurrency", default="", help="also run bench --concurrency with these levels (e.g. 1,2,4)")
    p.add_argument("--bench-tokens", type=int, default=8)
    args = p.parse_args(argv)
    args.extra = extra
    runs = []
    for n in [int(x) for x in args.workers.split(",")]:
        for experts in (args.experts.split(",") if n > 1 else ["local"]):
            runs.append(run(args.model, n, experts, args))
            progress = {k: runs[-1][k] for k in ("workers", "experts", "stage_load_s", "decode")}
            print(json.dumps(progress), file=sys.stderr, flush=True)
    print(json.dumps({"model": str(args.model), "disk_rate": args.disk_rate, "memory_gb": args.memory_gb,
                      "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
