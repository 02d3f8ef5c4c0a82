"""The commands of `deltafin-coordinator` (and `deltafin serve`) once their flags are read: plan, generate, serve
and bench. cli/coordinator.py makes the parser and imports this module only to run a command (torch, gRPC and the
HTTP stack load here, so `--help` is immediate)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

from deltafin.checkpoint.config import load_config
from deltafin.cli.console import stop_on_signals
from deltafin.cli.flags import cluster_from_args, sampling_from_args, serving_from_args, stage_from_args
from deltafin.cli.serve_bench import bench_serving
from deltafin.coordinator.cluster.cluster_options import ClusterOptions
from deltafin.coordinator.cluster.connect import cluster_spec, local_plan
from deltafin.coordinator.cluster.workers import capacities, find_workers, plan_cluster, replanner
from deltafin.coordinator.engine.engine import Engine, open_engine, planned_stage
from deltafin.coordinator.engine.events import Finished
from deltafin.coordinator.engine.generation import Generation
from deltafin.coordinator.engine.report import PrefillReporter, format_summary, run_summary
from deltafin.coordinator.engine.serving_options import ServingOptions
from deltafin.coordinator.engine.token_loop import PlainText
from deltafin.coordinator.http import server
from deltafin.errors import DeltafinError
from deltafin.plan.cluster.cluster_plan import ClusterPlan
from deltafin.plan.cluster.expert_placement import split
from deltafin.plan.outlook import expert_copies, mode_lines, outlook
from deltafin.plan.timing.hops import describe_hops
from deltafin.plan.timing.predict import plan_summary
from deltafin.runtime.stage_options import StageOptions
from deltafin.transport.ports import cannot_listen, check_free

log = logging.getLogger("deltafin.coordinator")


def _options(args: argparse.Namespace) -> tuple[ClusterOptions, StageOptions, ServingOptions]:
    """The command's options as typed values, checked before anything loads."""
    return cluster_from_args(args), stage_from_args(args), serving_from_args(args)


async def _open(args: argparse.Namespace, serving: ServingOptions | None = None) -> Engine:
    cluster, stage, flags = _options(args)
    return await open_engine(cluster, stage, serving or flags)


async def cmd_plan(args: argparse.Namespace) -> int:
    cluster, stage, serving = _options(args)
    cfg = load_config(cluster.model)
    if cluster.local:
        print(local_plan(cluster, planned_stage(stage, serving), cfg))
        return 0
    spec = cluster_spec(cluster, planned_stage(stage, serving), cfg)
    workers = await find_workers(spec)
    try:
        plan = await plan_cluster(spec, cfg, workers)
        more = outlook(plan, cfg, spec.sizing, replanner(spec, cfg, workers, plan))
        copies = expert_copies(cfg, stage.mode, plan)
        if args.json:
            print(json.dumps({**plan_summary(cfg, plan, args.prompt_tokens, spec.act_bytes), "outlook": more,
                              "expert_mode": stage.expert_mode, "expert_copy": dict(copies),
                              "timeouts": dataclasses.asdict(spec.timeouts)}, indent=1))
        else:
            print(plan.table())
            rooms = {c.name: c.spine_disk.room if c.spine_disk else None for c in capacities(workers, spec.memory_cap)}
            print("\n".join(mode_lines(cfg, stage.mode, copies, rooms)))
            print("\n".join([*describe_hops(cfg, plan, spec.act_bytes), *more]))
            print(f"timeouts: {spec.timeouts.describe()}")
            print("\n".join(download_commands(plan)))
    finally:
        await asyncio.gather(*(c.close() for c, _ in workers))
    return 0


def download_commands(plan: ClusterPlan) -> list[str]:
    """What each worker of `plan` needs on its disk, as `deltafin download` commands: its stage's layers; with wide
    experts every layer (each worker computes its share of every MoE layer) and its share of the experts."""
    lines = ["put the model on each worker (SOURCE: hf:ORG/NAME or a directory; DIR: the worker's --model):"]
    placement = plan.experts
    for s in plan.workers:
        i = 0 if placement is None else placement.holders.index(s.key)
        bounds = [] if placement is None else [placement.share(i, layer) for layer in placement.layers]
        lo, hi = min((r.start for r in bounds), default=0), max((r.stop for r in bounds), default=0)
        if placement is None or hi <= lo:  # its own layers' experts, or none to serve
            what = f"--layers {s.start}-{s.end - 1}"
        else:  # one range of ids for every layer: a superset of its shares where they differ by layer
            equal = split(0, placement.num_experts, [1.0] * len(placement.holders))
            what = (f"--experts {i}/{len(placement.holders)}" if all(r == range(equal[i], equal[i + 1])
                                                                     for r in bounds) else f"--experts {lo}-{hi - 1}")
        lines.append(f"  {s.worker}: deltafin download SOURCE --out DIR {what}")
    return lines


async def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)  # bad values fail before anything loads
    if args.max_tokens is not None and args.max_tokens < 1:
        raise DeltafinError("--max-tokens must be at least 1")
    engine = await _open(args)
    try:
        ids = engine.tokenizer.encode(args.prompt)
        if not ids:
            raise DeltafinError("the prompt is empty")
        out_ids: list[int] = []
        text: list[str] = []
        finished, at_first = None, None
        async for event in engine.run(ids, PlainText(engine.tokenizer),
                                      Generation(args.max_tokens, params, tuple(args.stop)),
                                      progress=PrefillReporter()):
            if isinstance(event, Finished):
                finished = event
            else:
                out_ids.append(event.token_id)
                if args.json and at_first is None:  # between forwards: the workers' counters at decode's start
                    at_first = await engine.worker_stats()
            piece = event.delta.content
            text.append(piece)
            if not args.json:
                print(piece, end="", flush=True)
        stats = await engine.worker_stats()
    finally:
        await engine.close()
    assert finished is not None
    summary = run_summary(finished, stats, at_first)
    if args.json:
        print(json.dumps({"prompt_ids": ids, "ids": out_ids, "text": "".join(text), "finish_reason": finished.reason,
                          **summary}))
    else:
        print()
        print(format_summary(summary), file=sys.stderr)
    return 0


async def cmd_serve(args: argparse.Namespace) -> int:
    cluster, stage, serving = _options(args)
    api_key = _api_key(args)
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without an API key: anyone who can reach it can generate (set --api-key)",
                    args.host)
    check_free(args.host, args.port, "the API")  # before loading: the model takes minutes to load
    engine = await open_engine(cluster, stage, serving)
    try:
        runner, port = await server.start(engine, args.host, args.port, int(args.max_body_mb * (1 << 20)),
                                          api_key)
    except OSError as e:
        await engine.close()
        raise cannot_listen(args.host, args.port, "the API", e) from None
    print(f"serving http://{args.host}:{port} (model '{engine.model_name}'; web chat at /)", flush=True)
    stop = stop_on_signals(args.prog)
    try:
        await stop.wait()
        log.info("shutting down: no new requests; %d running get %.0f s to finish (--shutdown-grace); a second "
                 "signal exits now", engine.active, args.shutdown_grace)
        await server.stop_listening(runner)
        engine.begin_shutdown(max(0.0, args.shutdown_grace))
        await engine.drained(args.shutdown_grace + 30)  # the ended ones release their sessions, then they go
    finally:
        await runner.cleanup()
        await engine.close()
    return 0


async def cmd_bench(args: argparse.Namespace) -> int:
    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1 or args.prompt_tokens < 1 or args.max_tokens < 1 or args.long_prompt < 0:
        raise DeltafinError("--concurrency takes positive counts (e.g. 1,2,4); --prompt-tokens and --max-tokens "
                            "must be at least 1, --long-prompt at least 0")
    serving = serving_from_args(args)
    engine = await _open(args, dataclasses.replace(
        serving, max_active=max(serving.max_active, max(levels) + bool(args.long_prompt))))
    try:
        result = await bench_serving(engine, levels, args.prompt_tokens, args.max_tokens, args.seed,
                                     args.long_prompt)
    finally:
        await engine.close()
    print(json.dumps(result, indent=2))
    return 0


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as e:
            raise DeltafinError(f"cannot read the API key file {args.api_key_file}: {e.strerror or e}") from None
    else:
        key = (args.api_key if args.api_key is not None else os.environ.get("DELTAFIN_API_KEY", "")).strip()
    return key or None


COMMANDS = {"generate": cmd_generate, "plan": cmd_plan, "serve": cmd_serve, "bench": cmd_bench}
