"""`deltafin-coordinator`: find workers, plan the layers over them, and generate or serve.

    deltafin-coordinator --model DIR plan                    show the plan only
    deltafin-coordinator --model DIR generate "prompt"       generate, printing tokens as they come
    deltafin-coordinator --model DIR serve --port 8000       the OpenAI-compatible HTTP API
    deltafin-coordinator --model DIR bench --concurrency 1,2,4   concurrent requests: tok/s, stage utilization
    deltafin-coordinator --model DIR --local generate ...    single-machine mode: the same loop, in-process

Workers are found over Bonjour (`_deltafin._tcp.local.`) and/or named with --worker host:port.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltafin.checkpoint.config import load_config
from deltafin.cli.console import Parser, add_logging_options, log_level, run_cli, setup_logging, stop_on_signals
from deltafin.cli.flags import (
    add_cluster_options,
    add_fields,
    add_sampling_options,
    add_serving_options,
    add_speculative_option,
    cluster_from_args,
    sampling_from_args,
    serving_from_args,
    stage_from_args,
)
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
from deltafin.paths import bundled_model
from deltafin.plan.cluster.expert_placement import split
from deltafin.plan.outlook import expert_copies, mode_lines, outlook
from deltafin.plan.timing.hops import describe_hops
from deltafin.plan.timing.predict import plan_summary
from deltafin.runtime.stage_options import StageOptions
from deltafin.transport.ports import cannot_listen, check_free

if TYPE_CHECKING:
    from deltafin.plan.cluster.cluster_plan import ClusterPlan

log = logging.getLogger("deltafin.coordinator")


def _common_options(after_command: bool) -> argparse.ArgumentParser:
    """The options every command takes, before or after its name. After it, they have no defaults of their
    own (argparse.SUPPRESS), so that they override what came before it rather than reset it."""
    common = argparse.ArgumentParser(add_help=False)
    add_cluster_options(common, model_required=False)  # checked after parsing: it may come on either side
    add_logging_options(common)
    if after_command:
        for action in common._actions:
            action.default = argparse.SUPPRESS
    return common


SERVE_HELP = "serve the HTTP APIs (OpenAI, Anthropic, Ollama, OpenAI Responses) and a web chat"
SERVE_DESCRIPTION = (
    "Serves OpenAI's /v1/chat/completions, /v1/completions, /v1/models and /v1/models/{name}; OpenAI's Responses API "
    "at /v1/responses; Anthropic's /v1/messages and /v1/messages/count_tokens; Ollama's /api/chat, /api/generate, "
    "/api/tags, /api/show, /api/ps and /api/version; /v1/status (the cluster), /health and /metrics (Prometheus); "
    "and a web chat at / (its files under /web/{name}: streamed replies, reasoning, the cluster from /v1/status). "
    "Prints 'serving http://HOST:PORT' once ready. SIGINT/SIGTERM: it takes no new requests, lets those running "
    "finish for --shutdown-grace seconds, ends the rest (a stream with an error event, a whole response with 503) "
    "and exits; a second signal exits at once.")
LOCAL_SERVE_DESCRIPTION = ("The one-machine server: the model runs in this process (as `deltafin-coordinator --local "
                           "serve` does), k3-mini unless --model names another. " + SERVE_DESCRIPTION)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="deltafin-coordinator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
               parents=[_common_options(False)])
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    after = _common_options(True)

    def command(name: str, **kw: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[after], **kw)

    g = command("generate", help="generate a continuation of a prompt (greedy unless --temperature)",
                       description="Generate a continuation of PROMPT (plain text, no chat format), printing "
                       "tokens as they come and a stats line (tok/s, s/token, bytes read, hit rate) on stderr.")
    g.add_argument("prompt", help="the prompt text")
    add_sampling_options(g, temperature=0.0, max_tokens=32)
    g.add_argument("--json", action="store_true", help="print one JSON object (ids, text, stats) at the end")
    pl = command("plan", help="find workers and print the layer plan (assigns nothing); with --local, this "
                              "process's plan (loads nothing)",
                 description="Find the workers, measure the links to and between them, and print the plan: each "
                 "stage's layers, spine and memory, the links, the experts' mode and why, and the predicted time of "
                 "a token and of a prompt's first token (disks and links). Assigns nothing.")
    add_speculative_option(pl)
    pl.add_argument("--json", action="store_true", help="print the plan as one JSON object instead of the table")
    pl.add_argument("--prompt-tokens", type=int, action="append", default=[], metavar="N",
                    help="also predict the first token of a prompt of N tokens (repeatable; JSON: prompts)")
    _add_serve_options(command("serve", help=SERVE_HELP, description=SERVE_DESCRIPTION))
    b = command("bench", help="concurrent requests through the serving engine: tok/s and stage utilization",
                       description="For each concurrency N, N requests at once (seeded random prompts, exactly "
                       "--max-tokens tokens each) through the same scheduler the server uses; prints JSON: "
                       "aggregate tok/s, per-request decode tok/s, time to first token, batches, and each stage's "
                       "utilization (its forwards' time over the wall time).")
    b.add_argument("--concurrency", default="1,2,4", help="comma-separated request counts (default 1,2,4; "
                   "--max-active is raised to the largest)")
    b.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of every request (default 64)")
    b.add_argument("--max-tokens", type=int, default=16, help="tokens every request generates (default 16)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    b.add_argument("--long-prompt", type=int, default=0, metavar="T",
                   help="also start one request with a T-token prompt beside the streams: its time to first token "
                   "and the streams' speed meanwhile (compare --prefill-batches ride and separate)")
    add_serving_options(b)
    return p


def _add_serve_options(s: argparse.ArgumentParser) -> None:
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    add_fields(s, ServingOptions, ["served_model_name", "strict_model_name", "default_max_tokens"])
    s.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body (default 8 MB)")
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` or `x-api-key: KEY` on every endpoint but /health "
                   "and the web chat's page (or $DELTAFIN_API_KEY, "
                   "or --api-key-file)")
    s.add_argument("--api-key-file", default=None, help="read the API key from this file")
    s.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds running requests get to finish after SIGINT/SIGTERM (default 10)")
    add_serving_options(s)


def _serve_parser(prog: str) -> argparse.ArgumentParser:
    """`deltafin serve`'s parser: the coordinator's options and serve's, k3-mini unless --model says."""
    p = Parser(prog=prog, description=LOCAL_SERVE_DESCRIPTION, parents=[_common_options(False)])
    p.set_defaults(model=str(bundled_model()))
    _add_serve_options(p)
    return p


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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.model:
        parser.error("the following arguments are required: --model")
    return _run(args, parser.prog)


def serve_main(argv: list[str], prog: str = "deltafin serve") -> int:
    """`deltafin serve ARGS`: `deltafin-coordinator --local serve ARGS`, the bundled model unless --model says, with
    a parser of its own, so that its usage, help and errors say `deltafin serve`."""
    args = _serve_parser(prog).parse_args(argv)
    args.local, args.command = True, "serve"
    return _run(args, prog)


def _run(args: argparse.Namespace, prog: str) -> int:
    setup_logging(log_level(args))
    args.prog = prog  # what a message names this process by (a second signal's)
    command = {"generate": cmd_generate, "plan": cmd_plan, "serve": cmd_serve, "bench": cmd_bench}[args.command]
    return run_cli(lambda: asyncio.run(command(args)))


if __name__ == "__main__":
    sys.exit(main())
