"""`deltafin-coordinator`: find workers, plan the layers over them, and generate.

    deltafin-coordinator --model DIR plan                  show the plan only
    deltafin-coordinator --model DIR generate "prompt"     generate, printing tokens as they come
    deltafin-coordinator --model DIR --local generate ...  single-machine mode: the same loop, in-process

Workers are found over Bonjour (`_deltafin._tcp.local.`) and/or named with --worker host:port.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

from deltafin.cli import _add_stage_options, run_cli, setup_logging, stage_options
from deltafin.config import load_config
from deltafin.errors import DeltafinError

log = logging.getLogger("deltafin.coordinator")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltafin-coordinator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the checkpoint directory (same files as the workers')")
    p.add_argument("--worker", action="append", default=[], metavar="HOST:PORT",
                   help="a worker to use (repeatable); discovered workers are added unless --no-discover")
    p.add_argument("--no-discover", action="store_true", help="use only the --worker addresses")
    p.add_argument("--discover-timeout", type=float, default=3.0, help="seconds to browse for workers")
    p.add_argument("--expect", type=int, default=None, help="stop browsing once this many workers answered")
    p.add_argument("--interface", action="append", default=None, help="browse only on this interface address")
    p.add_argument("--local", action="store_true", help="single-machine mode: run the stages in this process")
    p.add_argument("--local-stages", type=int, default=1, help="--local: in-process stages (default 1)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"], help="--local: device")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="activation dtype")
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    _add_stage_options(p)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    g = sub.add_parser("generate", help="generate a continuation of a prompt")
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--json", action="store_true", help="print one JSON object (ids, text, stats) at the end")
    sub.add_parser("plan", help="find workers and print the layer plan (assigns nothing)")
    return p


def _user_options(args: argparse.Namespace) -> dict[str, Any]:
    """Stage options the user set explicitly (sent to workers; the rest are the workers' own)."""
    defaults = build_parser().parse_args(["--model", "x", "plan"])
    chosen = stage_options(args)
    base = stage_options(defaults)
    out = {f.name: getattr(chosen, f.name) for f in dataclasses.fields(chosen)
           if getattr(chosen, f.name) != getattr(base, f.name) and f.name != "dtype"}
    out["dtype"] = args.dtype
    return out


async def open_backend(args: argparse.Namespace, show_progress: bool = True):
    """The backend the command runs on: in-process stages with --local, else the cluster."""
    from .backend import LocalBackend
    from .cluster import ClusterSpec, connect_cluster

    if args.local:
        from deltafin.pipeline import LocalPipeline

        pipe = await asyncio.to_thread(LocalPipeline.load, args.model, args.local_stages, args.device, args.dtype,
                                       "hf", stage_options(args))
        return LocalBackend(pipe)
    spec = ClusterSpec(Path(args.model), addresses=args.worker, discover=not args.no_discover,
                       discover_timeout=args.discover_timeout, expect=args.expect, interfaces=args.interface,
                       options=_user_options(args), spine=args.spine)
    backend, plan = await connect_cluster(spec, show_progress=show_progress)
    print(plan.table(), file=sys.stderr)
    return backend


async def cmd_plan(args: argparse.Namespace) -> int:
    from deltafin.planner import plan_layers

    from .cluster import ClusterSpec, capacities, find_workers

    spec = ClusterSpec(Path(args.model), addresses=args.worker, discover=not args.no_discover,
                       discover_timeout=args.discover_timeout, expect=args.expect, interfaces=args.interface,
                       spine=args.spine)
    workers = await find_workers(spec)
    try:
        print(plan_layers(load_config(args.model), capacities(workers), spine=args.spine).table())
    finally:
        await asyncio.gather(*(c.close() for c, _ in workers))
    return 0


async def cmd_generate(args: argparse.Namespace) -> int:
    from deltafin.tokenizer import K3Tokenizer

    from .generation import Finished, Request, generate

    tokenizer = K3Tokenizer.load(args.model)
    cfg = load_config(args.model)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise DeltafinError("the prompt is empty")
    stops = frozenset(i for i in (cfg.eos_token_id, tokenizer.specials.get("[EOS]")) if i is not None)
    backend = await open_backend(args)
    out_ids: list[int] = []
    text: list[str] = []
    try:
        async for event in generate(backend, tokenizer, Request(ids, args.max_tokens, stops)):
            if isinstance(event, Finished):
                text.append(event.text)
                finished = event
            else:
                out_ids.append(event.token_id)
                text.append(event.text)
                if not args.json:
                    print(event.text, end="", flush=True)
        stats = await backend.stats()
    finally:
        await backend.close()
    summary = _summary(finished, stats)
    if args.json:
        print(json.dumps({"prompt_ids": ids, "ids": out_ids, "text": "".join(text), "finish_reason": finished.reason,
                          **summary}))
    else:
        print(finished.text)
        print(f"[{summary['completion_tokens']} tokens, {summary['tok_per_s']:.2f} tok/s, "
              f"{summary['s_per_token']:.3f} s/token, {summary['bytes_read'] / 1e9:.3f} GB read, "
              f"expert hit rate {summary['hit_rate']:.1%}]", file=sys.stderr)
    return 0


def _summary(finished: Any, stats: list[dict[str, Any]]) -> dict[str, Any]:
    experts = [s.get("experts", {}) for s in stats]
    lookups = sum(e.get("lookups", 0) for e in experts)
    n = finished.usage.completion_tokens
    return {"prompt_tokens": finished.usage.prompt_tokens, "completion_tokens": n,
            "tok_per_s": finished.tokens_per_second,
            "s_per_token": finished.decode_seconds / max(1, n - 1), "prefill_s": finished.prefill_seconds,
            "bytes_read": sum(e.get("bytes_read", 0) + 0 for e in experts),
            "hit_rate": sum(e.get("hits", 0) for e in experts) / lookups if lookups else 0.0}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(-1 if args.quiet else args.verbose)
    command = {"generate": cmd_generate, "plan": cmd_plan}[args.command]
    return run_cli(lambda: asyncio.run(command(args)))


if __name__ == "__main__":
    sys.exit(main())
