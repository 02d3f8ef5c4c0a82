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
import sys
from typing import Any

from deltafin.cli.console import Parser, add_logging_options, log_level, run_cli, setup_logging
from deltafin.cli.flags import (
    add_cluster_options,
    add_fields,
    add_sampling_options,
    add_serving_options,
    add_speculative_option,
)
from deltafin.coordinator.engine.serving_options import ServingOptions
from deltafin.paths import bundled_model


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
    from deltafin.cli.coordinator_commands import COMMANDS  # torch, gRPC, the HTTP stack: loaded to run, not for --help

    return run_cli(lambda: asyncio.run(COMMANDS[args.command](args)))


if __name__ == "__main__":
    sys.exit(main())
