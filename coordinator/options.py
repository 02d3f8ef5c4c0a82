"""The coordinator's command-line option groups, and what they open: the backend (workers or in-process
stages) and the serving engine. `deltafin-coordinator`, `deltafin chat` and `deltafin demo` share them."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

from deltafin.checkpoint.config import load_config
from deltafin.errors import DeltafinError
from deltafin.options import add_stage_options, explicit_options, stage_options
from deltafin.text.chat import SERVING_MAX_TOKENS

log = logging.getLogger(__name__)


def add_cluster_options(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    """Where the model runs: discovered/named workers, or in-process (--local)."""
    p.add_argument("--model", required=model_required, help="the checkpoint directory (same files as the workers')")
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
    p.add_argument("--experts", default="auto", choices=["auto", "wide", "local"],
                   help="wide: every worker reads and computes its share of every layer's routed experts, so every "
                   "disk works on every token; local: each stage reads its own layers' experts; auto (default): "
                   "wide with more than one worker")
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
    add_recovery_options(p)


def add_recovery_options(p: argparse.ArgumentParser) -> None:
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
                   "forward (the same output; fewer passes over the weights when drafts land; the plan gives "
                   "every sequence room for a verification's KDA trail, 0.21 GB at K3's width); none: one token "
                   "per forward (default)")


def speculative_tokens(args: argparse.Namespace) -> int:
    """Tokens one speculative forward verifies, for the memory plan: the most with --speculative, else 0."""
    from deltafin.plan.sizing import SPECULATIVE_TOKENS

    return SPECULATIVE_TOKENS if args.speculative != "none" else 0


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
    from deltafin.text.sampling import SamplingParams

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
                   help="batches in flight through the stages at once (default 0: one per stage that computes "
                   "beside the others, so every stage works; CPU workers on one host share its cores and count "
                   "once; 1: one batch of all active requests)")
    p.add_argument("--prefill-batches", default="ride", choices=["ride", "separate"],
                   help="ride: running streams' decode steps go in the same batch as the next prompt chunk "
                   "(default; at K3's sizes a chunk reads nearly every expert, so the steps cost no reads); "
                   "separate: prompt chunks and decode steps take turns in batches of their own")


def _user_options(args: argparse.Namespace) -> dict[str, Any]:
    """Stage options sent with every assignment (the plan adds each stage's budgets)."""
    chosen = explicit_options(args)
    return {"dtype": args.dtype, **{k: chosen[k] for k in ("io", "read_threads", "cache_policy", "prefetch")}}


async def open_backend(args: argparse.Namespace, show_progress: bool = True):
    """The backend the command runs on: in-process stages with --local, else the cluster."""
    from deltafin.coordinator.cluster.backend import LocalBackend
    from deltafin.coordinator.cluster.recovery import connect_cluster

    if args.local:
        from deltafin.devices import resolve_device, resolve_dtype
        from deltafin.runtime.pipeline import LocalPipeline

        options = dataclasses.replace(stage_options(args, resolve_device(args.device), resolve_dtype(args.dtype)),
                                      speculative_tokens=speculative_tokens(args))
        pipe = await asyncio.to_thread(LocalPipeline.load, args.model, args.local_stages, args.device, args.dtype,
                                       "hf", options, show_progress)
        return LocalBackend(pipe)
    from deltafin.coordinator.cluster.recovery import RecoveryOptions

    spec = cluster_spec(args, _user_options(args))
    backend, plan = await connect_cluster(spec, show_progress=show_progress, recovery=RecoveryOptions(
        enabled=not args.no_recovery, rejoin_interval=args.rejoin_interval,
        journal_tokens=args.replay_journal_tokens))
    if show_progress:
        print(plan.table(), file=sys.stderr)
    else:
        log.info("the plan:\n%s", plan.table())
    return backend


def cluster_spec(args: argparse.Namespace, options: dict[str, Any] | None = None):  # -> ClusterSpec
    from deltafin.checkpoint.shards import scan_checkpoint
    from deltafin.coordinator.cluster.backend import Timeouts
    from deltafin.coordinator.cluster.workers import ClusterSpec
    from deltafin.runtime.stage import StageOptions
    from deltafin.transport.auth import ClientTls, ClusterSecurity, load_key
    from deltafin.weights.reader import layer_spans

    if args.worker_timeout <= 0 or args.forward_timeout <= 0:
        raise DeltafinError("--worker-timeout and --forward-timeout must be positive")
    if args.expert_dir:
        raise DeltafinError("--expert-dir is a disk of this machine: give it to each deltafin-worker (or use --local)")
    tls = None
    if args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name:
        tls = ClientTls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
        tls.credentials()  # unreadable files fail here, with their names
    security = ClusterSecurity(load_key(args.cluster_key, args.cluster_key_file), tls)
    timeouts = Timeouts(forward=args.forward_timeout, lost_after=args.worker_timeout,
                        probe_interval=min(2.0, args.worker_timeout / 3))
    wanted = StageOptions(**explicit_options(args), speculative_tokens=speculative_tokens(args))
    sizing = wanted.sizing_options(layer_spans(scan_checkpoint(args.model, load_config(args.model))))
    return ClusterSpec(Path(args.model), addresses=args.worker, discover=not args.no_discover,
                       discover_timeout=args.discover_timeout, expect=args.expect, interfaces=args.interface,
                       options=options or {}, sizing=sizing, act_bytes=2 if args.dtype == "bf16" else 4,
                       memory_cap=None if args.memory_gb is None else int(args.memory_gb * 1e9), timeouts=timeouts,
                       security=security, experts=args.experts)


async def open_engine(args: argparse.Namespace, name: str | None = None, show_progress: bool = True,
                      **serving: Any):
    """Tokenizer and config first (fast, clear errors), then the backend, as one Engine. `show_progress`: the
    load's progress and the plan on stderr (else the plan is logged)."""
    from deltafin.coordinator.engine.engine import Engine
    from deltafin.text.tokenizer import K3Tokenizer

    cfg = load_config(args.model)
    tokenizer = K3Tokenizer.load(args.model)
    backend = await open_backend(args, show_progress)
    serving.setdefault("speculative", args.speculative)
    return Engine(backend, tokenizer, cfg, name or Path(args.model).resolve().name, prefix_cache=True, **serving)
