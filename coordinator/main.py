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
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from deltafin.chat import SERVING_MAX_TOKENS
from deltafin.cli import run_cli, setup_logging
from deltafin.config import load_config
from deltafin.errors import DeltafinError
from deltafin.options import add_stage_options, explicit_options, stage_options

log = logging.getLogger("deltafin.coordinator")


def add_cluster_options(p: argparse.ArgumentParser) -> None:
    """Where the model runs: discovered/named workers, or in-process (--local)."""
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
    add_stage_options(p)
    sec = p.add_argument_group("security",
                               "how this coordinator proves itself to workers (see deploy/README.md, Security)")
    sec.add_argument("--cluster-key", default=None,
                     help="the workers' shared secret (or $DELTAFIN_CLUSTER_KEY, or --cluster-key-file)")
    sec.add_argument("--cluster-key-file", default=None, help="read the cluster key from this file")
    sec.add_argument("--tls-ca", default=None,
                     help="connect with TLS, trusting workers' certificates signed by this CA (PEM)")
    sec.add_argument("--tls-cert", default=None, help="mutual TLS: this coordinator's certificate (PEM)")
    sec.add_argument("--tls-key", default=None, help="mutual TLS: its private key (PEM)")
    sec.add_argument("--tls-server-name", default=None,
                     help="the name the workers' certificates carry, when it is not the address dialled")
    rec = p.add_argument_group("fault tolerance")
    rec.add_argument("--worker-timeout", type=float, default=10.0,
                     help="a worker that answers nothing for this many seconds during a forward is lost "
                     "(default 10)")
    rec.add_argument("--forward-timeout", type=float, default=600.0,
                     help="deadline of one stage's forward of up to 512 tokens, longer ones in proportion (default "
                     "600: one prompt chunk may stream every expert of the stage)")
    rec.add_argument("--no-recovery", action="store_true",
                     help="fail requests when a worker is lost instead of re-planning and replaying")
    rec.add_argument("--replay-journal-tokens", type=int, default=1 << 22,
                     help="tokens of live sequences kept for replay after a worker loss, 4 bytes each (default "
                     "4194304 = 16 MB); sequences beyond it fail instead of recovering")
    rec.add_argument("--rejoin-interval", type=float, default=5.0,
                     help="seconds between looks for returning or new workers while idle (0: never; default 5)")


def add_speculative_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", default="none", choices=["none", "ngram"],
                   help="ngram: draft tokens from the prompt and the output so far and verify several in one "
                   "forward (the same output; fewer passes over the weights when drafts land); none: one token "
                   "per forward (default)")


def add_sampling_options(p: argparse.ArgumentParser, temperature: float, max_tokens: int | None) -> None:
    add_speculative_option(p)
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"tokens to generate at most (default {max_tokens or f'up to {SERVING_MAX_TOKENS}'})")
    p.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 is greedy (default {temperature:g})")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens up to this mass")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the best one's p")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (same seed, same output)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace):  # -> SamplingParams
    from deltafin.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, seed=args.seed)


def add_serving_options(p: argparse.ArgumentParser) -> None:
    add_speculative_option(p)
    p.add_argument("--max-active", type=int, default=4,
                   help="requests generating at once; their steps are batched (default 4)")
    p.add_argument("--queue-depth", type=int, default=16,
                   help="requests waiting for a slot; more are refused with 429 (default 16)")
    p.add_argument("--max-context", type=int, default=131072,
                   help="prompt + generated tokens per request (default 131072)")
    p.add_argument("--pipeline-depth", type=int, default=0,
                   help="batches in flight through the stages at once (default 0: one per stage, so every stage "
                   "works; 1: one batch of all active requests, better when the workers share one machine's cores)")
    p.add_argument("--prefill-batches", default="ride", choices=["ride", "separate"],
                   help="ride: running streams' decode steps go in the same batch as the next prompt chunk "
                   "(default; at K3's sizes a chunk reads nearly every expert, so the steps cost no reads); "
                   "separate: prompt chunks and decode steps take turns in batches of their own")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltafin-coordinator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_options(p)
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    g = sub.add_parser("generate", help="generate a continuation of a prompt (greedy unless --temperature)",
                       description="Generate a continuation of PROMPT (plain text, no chat format), printing "
                       "tokens as they come and a stats line (tok/s, s/token, bytes read, hit rate) on stderr.")
    g.add_argument("prompt", help="the prompt text")
    add_sampling_options(g, temperature=0.0, max_tokens=32)
    g.add_argument("--json", action="store_true", help="print one JSON object (ids, text, stats) at the end")
    sub.add_parser("plan", help="find workers and print the layer plan (assigns nothing)")
    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and "
                       "/metrics. Prints 'serving http://HOST:PORT' once ready; SIGINT/SIGTERM stop it.")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients ask for (default: the model directory's name)")
    s.add_argument("--default-max-tokens", type=int, default=SERVING_MAX_TOKENS,
                   help=f"max tokens for chat requests that do not say (default {SERVING_MAX_TOKENS}: at K3's "
                   "fraction of a token per second, more is hours)")
    s.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body (default 8 MB)")
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every endpoint but /health (or $DELTAFIN_API_KEY, "
                   "or --api-key-file)")
    s.add_argument("--api-key-file", default=None, help="read the API key from this file")
    add_serving_options(s)
    b = sub.add_parser("bench", help="concurrent requests through the serving engine: tok/s and stage utilization",
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


def _user_options(args: argparse.Namespace) -> dict[str, Any]:
    """Stage options sent with every assignment (the plan adds each stage's budgets)."""
    chosen = explicit_options(args)
    return {"dtype": args.dtype, **{k: chosen[k] for k in ("io", "read_threads", "cache_policy", "prefetch")}}


async def open_backend(args: argparse.Namespace, show_progress: bool = True):
    """The backend the command runs on: in-process stages with --local, else the cluster."""
    from .backend import LocalBackend
    from .cluster import connect_cluster

    if args.local:
        from deltafin.devices import resolve_device, resolve_dtype
        from deltafin.pipeline import LocalPipeline

        options = stage_options(args, resolve_device(args.device), resolve_dtype(args.dtype))
        pipe = await asyncio.to_thread(LocalPipeline.load, args.model, args.local_stages, args.device, args.dtype,
                                       "hf", options, show_progress)
        return LocalBackend(pipe)
    from .recovery import RecoveryOptions

    spec = cluster_spec(args, _user_options(args))
    backend, plan = await connect_cluster(spec, show_progress=show_progress, recovery=RecoveryOptions(
        enabled=not args.no_recovery, rejoin_interval=args.rejoin_interval,
        journal_tokens=args.replay_journal_tokens))
    print(plan.table(), file=sys.stderr)
    return backend


def cluster_spec(args: argparse.Namespace, options: dict[str, Any] | None = None):  # -> ClusterSpec
    from deltafin.checkpoint import scan_checkpoint
    from deltafin.sizing import SizingOptions
    from deltafin.transport.auth import ClientTls, ClusterSecurity, load_key
    from deltafin.weights.reader import layer_spans

    from .backend import Timeouts
    from .cluster import ClusterSpec

    if args.worker_timeout <= 0 or args.forward_timeout <= 0:
        raise DeltafinError("--worker-timeout and --forward-timeout must be positive")
    tls = None
    if args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name:
        tls = ClientTls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
        tls.credentials()  # unreadable files fail here, with their names
    security = ClusterSecurity(load_key(args.cluster_key, args.cluster_key_file), tls)
    timeouts = Timeouts(forward=args.forward_timeout, lost_after=args.worker_timeout,
                        probe_interval=min(2.0, args.worker_timeout / 3))
    explicit = explicit_options(args)
    sizing = SizingOptions(spine=args.spine, expert_cache_bytes=explicit["expert_cache_bytes"],
                           prefix_bytes=explicit["prefix_bytes"], sequences=args.sequences, context=args.context,
                           forward_tokens=args.prefill_chunk,
                           read_threads=args.threads, max_resident_layers=args.max_resident_layers,
                           spans=layer_spans(scan_checkpoint(args.model, load_config(args.model))))
    return ClusterSpec(Path(args.model), addresses=args.worker, discover=not args.no_discover,
                       discover_timeout=args.discover_timeout, expect=args.expect, interfaces=args.interface,
                       options=options or {}, sizing=sizing, act_bytes=2 if args.dtype == "bf16" else 4,
                       memory_cap=None if args.memory_gb is None else int(args.memory_gb * 1e9), timeouts=timeouts,
                       security=security)


async def open_engine(args: argparse.Namespace, name: str | None = None, **serving: Any):
    """Tokenizer and config first (fast, clear errors), then the backend, as one Engine."""
    from deltafin.tokenizer import K3Tokenizer

    from .engine import Engine

    cfg = load_config(args.model)
    tokenizer = K3Tokenizer.load(args.model)
    backend = await open_backend(args)
    serving.setdefault("speculative", args.speculative)
    return Engine(backend, tokenizer, cfg, name or Path(args.model).resolve().name, prefix_cache=True, **serving)


async def cmd_plan(args: argparse.Namespace) -> int:
    from .cluster import find_workers, plan_cluster

    spec = cluster_spec(args)
    workers = await find_workers(spec)
    try:
        print(plan_cluster(spec, load_config(args.model), workers).table())
    finally:
        await asyncio.gather(*(c.close() for c, _ in workers))
    return 0


async def cmd_generate(args: argparse.Namespace) -> int:
    from deltafin.progress import Reporter

    from .generation import Finished, PlainText

    params = sampling_params(args)  # bad values fail before anything loads
    if args.max_tokens is not None and args.max_tokens < 1:
        raise DeltafinError("--max-tokens must be at least 1")
    engine = await open_engine(args)
    try:
        ids = engine.tokenizer.encode(args.prompt)
        if not ids:
            raise DeltafinError("the prompt is empty")
        out_ids: list[int] = []
        text: list[str] = []
        finished = None
        async for event in engine.run(ids, PlainText(engine.tokenizer), max_tokens=args.max_tokens,
                                      sampling=params, stop=args.stop, progress=Reporter("prefill", "tokens")):
            if isinstance(event, Finished):
                finished = event
            else:
                out_ids.append(event.token_id)
            piece = event.delta.content
            text.append(piece)
            if not args.json:
                print(piece, end="", flush=True)
        stats = await engine.worker_stats()
    finally:
        await engine.close()
    assert finished is not None
    summary = run_summary(finished, stats)
    if args.json:
        print(json.dumps({"prompt_ids": ids, "ids": out_ids, "text": "".join(text), "finish_reason": finished.reason,
                          **summary}))
    else:
        print()
        print(format_summary(summary), file=sys.stderr)
    return 0


def run_summary(finished: Any, stats: list[dict[str, Any]]) -> dict[str, Any]:
    """One generation's numbers, with the workers' expert I/O counters (cumulative for their stages)."""
    experts = [s.get("experts", {}) for s in stats]
    lookups = sum(e.get("lookups", 0) for e in experts)
    t = finished.timing
    return {"prompt_tokens": finished.usage.prompt_tokens, "completion_tokens": finished.usage.completion_tokens,
            "tok_per_s": t.tokens_per_second, "s_per_token": t.seconds_per_token, "prefill_s": t.prefill_s,
            "bytes_read": sum(e.get("bytes_read", 0) for e in experts),
            "hit_rate": sum(e.get("hits", 0) for e in experts) / lookups if lookups else None,
            "draft_tokens": finished.drafting.draft_tokens, "accepted_tokens": finished.drafting.accepted_tokens,
            "forwards": finished.drafting.forwards}


def format_summary(s: dict[str, Any]) -> str:
    hit = "all experts resident" if s["hit_rate"] is None else f"expert hit rate {s['hit_rate']:.1%}"
    drafts = (f", {s['accepted_tokens']}/{s['draft_tokens']} drafts taken in {s['forwards']} forwards"
              if s["draft_tokens"] else "")
    return (f"[{s['completion_tokens']} tokens, {s['tok_per_s']:.2f} tok/s, {s['s_per_token']:.3f} s/token, "
            f"prefill {s['prefill_s']:.2f} s, {s['bytes_read'] / 1e9:.3f} GB read, {hit}{drafts}]")


async def cmd_serve(args: argparse.Namespace) -> int:
    from . import server

    if (args.max_active < 1 or args.queue_depth < 0 or args.max_context < 2 or args.default_max_tokens < 1
            or args.pipeline_depth < 0):
        raise DeltafinError("--max-active and --default-max-tokens must be >= 1, --queue-depth and "
                            "--pipeline-depth >= 0, --max-context >= 2")
    api_key = _api_key(args)
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without an API key: anyone who can reach it can generate (set --api-key)",
                    args.host)
    engine = await open_engine(args, args.served_model_name, max_active=args.max_active,
                               queue_depth=args.queue_depth, max_context=args.max_context,
                               default_max_tokens=args.default_max_tokens, pipeline_depth=args.pipeline_depth,
                               ride=args.prefill_batches == "ride")
    try:
        runner, port = await server.start(engine, args.host, args.port, int(args.max_body_mb * (1 << 20)),
                                          api_key)
    except OSError as e:
        await engine.close()
        raise DeltafinError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    print(f"serving http://{args.host}:{port} (model '{engine.model_name}')", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("shutting down")
    finally:
        await runner.cleanup()
        await engine.close()
    return 0


async def cmd_bench(args: argparse.Namespace) -> int:
    from .serve_bench import bench_serving

    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1 or args.prompt_tokens < 1 or args.max_tokens < 1 or args.long_prompt < 0:
        raise DeltafinError("--concurrency takes positive counts (e.g. 1,2,4); --prompt-tokens and --max-tokens "
                            "must be at least 1, --long-prompt at least 0")
    args.max_active = max(args.max_active, max(levels) + bool(args.long_prompt))
    engine = await open_engine(args, max_active=args.max_active, queue_depth=args.queue_depth,
                               max_context=args.max_context, pipeline_depth=args.pipeline_depth,
                               ride=args.prefill_batches == "ride")
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
    args = build_parser().parse_args(argv)
    setup_logging(-1 if args.quiet else args.verbose)
    command = {"generate": cmd_generate, "plan": cmd_plan, "serve": cmd_serve, "bench": cmd_bench}[args.command]
    return run_cli(lambda: asyncio.run(command(args)))


if __name__ == "__main__":
    sys.exit(main())
