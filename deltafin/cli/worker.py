"""`deltafin-worker`: serve one pipeline stage of a Kimi K3 checkpoint over gRPC, announced over Bonjour.

The worker indexes its model directory (which may hold only some layers), measures its disk with the
expert reader, announces `_deltafin._tcp.local.`, and waits for a coordinator to assign it a layer range.
SIGTERM/SIGINT: stop announcing, finish or fail in-flight calls within the grace period, exit; a second signal
exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from deltafin.cli.console import Parser, add_logging_options, log_level, run_cli, setup_logging, stop_on_signals
from deltafin.cli.flags import MODEL_HELP, add_fields, add_stage_options, model_arg
from deltafin.runtime.stage_options import StageOptions
from deltafin.worker.worker_options import WorkerOptions


def build_parser() -> argparse.ArgumentParser:
    """The flags, made from WorkerOptions' fields (and the stage options every command shares)."""
    p = Parser(prog="deltafin-worker", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=model_arg, required=True, help=MODEL_HELP + " (all layers, or only this worker's)")
    add_fields(p, WorkerOptions, ["host", "port", "advertise", "device"])
    add_fields(p, StageOptions, ["dtype"])
    add_fields(p, WorkerOptions, ["name", "announce", "interface", "disk_gbps", "grace", "session_ttl",
                                  "max_message_mb"])
    add_logging_options(p)
    add_stage_options(p)
    sec = p.add_argument_group("security", "who may drive this worker (see deploy/README.md, Security)")
    add_fields(sec, WorkerOptions, ["cluster_key", "cluster_key_file", "tls_cert", "tls_key", "tls_client_ca",
                                    "tls_ca", "tls_server_name"])
    return p


async def _serve(options: WorkerOptions) -> int:
    from deltafin.worker.daemon import serve  # torch and gRPC: loaded once the flags are read (--help is instant)

    return await serve(options, stop_on_signals("deltafin-worker"), lambda line: print(line, flush=True))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(log_level(args))
    return run_cli(lambda: asyncio.run(_serve(WorkerOptions.of(vars(args)))))


if __name__ == "__main__":
    sys.exit(main())
