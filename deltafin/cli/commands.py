"""`deltafin`: one command with subcommands for checkpoints, model checks, benchmarks and chat.

Every subcommand reports a DeltafinError as one line on stderr and exits 1; it never prints a traceback
for a problem the user can fix.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from deltafin import __version__
from deltafin.checkpoint.presets import PRESETS
from deltafin.cli import demo, terminal_chat
from deltafin.cli.bench_command import add_bench_command
from deltafin.cli.console import Parser, add_logging_options, log_level, run_cli, setup_logging
from deltafin.cli.convert import add_convert_command, print_conversion
from deltafin.cli.doctor import add_doctor_command
from deltafin.cli.flags import (
    MODEL_HELP,
    add_fields,
    add_stage_options,
    model_arg,
    stage_within_memory,
)
from deltafin.cli.models import add_models_command
from deltafin.download.fetch import download
from deltafin.download.sources import open_source
from deltafin.errors import DeltafinError
from deltafin.formats import converted_spines
from deltafin.mini.synth import synthesize
from deltafin.paths import models_dir, name_of
from deltafin.plan.memory.sizing_options import SizingOptions
from deltafin.runtime.stage_options import StageOptions
from deltafin.runtime.worker_stats import StageStats
from deltafin.text.chat import ChatOptions, encode
from deltafin.text.tokenizer import K3Tokenizer

log = logging.getLogger("deltafin")


def _cmd_synth(args: argparse.Namespace) -> int:
    out = synthesize(args.preset, args.out, seed=args.seed, layers=args.layers, show_progress=not args.quiet,
                     sparse=args.sparse, order=args.order)
    print(out)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from deltafin.cli.inspection import (  # torch: loaded when the command runs
        cannot_fit,
        format_report,
        inspect_model,
    )

    memory = None if args.memory_gb is None else int(args.memory_gb * 1e9)
    report = inspect_model(args.model, memory, args.device, SizingOptions(spine=args.spine,
                                                                          sequences=args.sequences,
                                                                          context=args.context))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if report["problems"] or cannot_fit(report) else 0


def _add_synth(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth", help="write a synthetic checkpoint in the exact Kimi K3 layout",
                       description="Write a random-weight checkpoint in the exact Hugging Face Kimi K3 layout "
                       "(config.json, index, shards, MXFP4 experts, tokenizer files). Presets: tiny (a few MB, "
                       "tests), small (tens of MB), mini (k3-mini's geometry, where its training starts), k3-slice "
                       "(real K3 widths: several GB per layer), k3 (the full geometry: 93 layers, 896 experts, "
                       "vocabulary 163,840, vision shards; use --sparse).")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--seed", type=int, default=0, help="same seed -> byte-identical files (default 0)")
    p.add_argument("--layers", type=int, default=None,
                   help="number of decoder layers, at least 2 (default: tiny 6, small 8, mini 8, k3-slice 3, k3 93)")
    p.add_argument("--sparse", action="store_true",
                   help="leave experts and large matrices (not the embedding or routers) as holes that read as "
                   "zeros: full-size files in little disk (k3: 1.56 TB apparent, ~4 GB written)")
    p.add_argument("--order", default="canonical", choices=["canonical", "grouped"],
                   help="tensor order in each shard: canonical (as safetensors' save_file writes, the default) or "
                   "grouped (spine in spec order, then experts)")
    p.set_defaults(func=_cmd_synth)


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="describe a checkpoint and report any problems",
                       description="Read config.json, the safetensors index and every shard header (no tensor "
                       "data) and print layers, experts, spine bytes, expert bytes per token, contiguity and "
                       "problems. Exits 1 if the checkpoint has problems, or if the memory plan of --memory-gb "
                       "cannot fit.")
    p.add_argument("--model", type=model_arg, required=True, help=MODEL_HELP)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_fields(p, StageOptions, ["memory_bytes"], helps={
        "memory_bytes": "also show the memory plan of the whole model as one stage within this budget (more than 0; "
        "one that cannot fit says the least it needs, and inspect exits 1)"})
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps"], help="--memory-gb: where it runs")
    add_fields(p, SizingOptions, ["spine", "sequences", "context"], helps={
        "spine": "--memory-gb: spine format", "sequences": "--memory-gb: sequences planned for (default 1: one "
        "worker, one user)", "context": "--memory-gb: tokens a request may have (default: the model's own maximum, "
        "or the longest the memory holds beside the plan's expert cache, whichever is less)"})
    p.set_defaults(func=_cmd_inspect)


def _cmd_download(args: argparse.Namespace) -> int:
    out = args.out or str(models_dir() / _default_name(args.source))
    summary = download(open_source(args.source), out, args.layers, args.experts, show_progress=not args.quiet)
    print(summary.line())
    if args.out is None:
        print(f"(--model {name_of(Path(out))} finds it)")
    if args.convert:
        print_conversion(out, args.convert, None, args.quiet, "auto")
    return 0


def _default_name(source: str) -> str:
    """The name a download goes under by default: a Hub repository's name, a directory's name."""
    name = source.split("@", 1)[0].rstrip("/").rsplit("/", 1)[-1].removeprefix("hf:")
    if not name or name in (".", ".."):
        raise DeltafinError(f"cannot name a model after {source!r}: give --out DIR")
    return name


def _add_download(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("download", help="fetch what this machine's worker needs of a checkpoint",
                       description="Fetch the metadata files (config.json, the index, the tokenizer) and the shards "
                       "of --layers (with the embedding/head when they include the first or last layer), of every "
                       "MoE layer's routed experts only the --experts share, written at their offsets in sparse "
                       "shards (the layout and the index stay the checkpoint's). Every piece is read back and "
                       "checked; an interrupted run resumes where it stopped (.deltafin-download.json in --out). "
                       "`deltafin-coordinator plan` prints each worker's command.")
    p.add_argument("source", metavar="SOURCE",
                   help="hf:ORG/NAME[@REVISION] (the Hugging Face Hub: its cache, token and HF_HUB_OFFLINE) or a "
                   "checkpoint directory (a NAS, an external disk)")
    p.add_argument("--out", default=None,
                   help="the worker's model directory (created; default: the cache directory's models/NAME, NAME "
                   "being the repository's or the directory's name, which --model NAME then finds)")
    p.add_argument("--layers", default=None, metavar="A-B",
                   help="decoder layers A to B inclusive, as `plan` prints a stage (default: all)")
    p.add_argument("--experts", default=None, metavar="K/N",
                   help="only share K of N equal contiguous shares of every MoE layer's routed experts (0 <= K < N), "
                   "or A-B: expert ids A to B inclusive (default: all)")
    p.add_argument("--convert", default=None, choices=converted_spines(), metavar="FORMAT",
                   help="then convert the downloaded spine into the cache directory, as `deltafin convert --spine "
                   f"FORMAT` does ({' or '.join(reversed(converted_spines()))})")
    p.set_defaults(func=_cmd_download)


def _cmd_logits(args: argparse.Namespace) -> int:
    from deltafin.runtime.pipeline import compute_logits  # torch: loaded when the command runs

    try:
        ids = [int(x) for x in args.ids.split(",") if x.strip()]
    except ValueError:
        raise DeltafinError(f"--ids must be comma-separated integers, got {args.ids!r}") from None
    stats: list[StageStats] = []
    options = stage_within_memory(args)
    logits = compute_logits(args.model, ids, device=args.device, dtype=args.dtype, mode=args.mode,
                            stages=args.stages, eps_convention=args.eps, options=options,
                            stats=stats if args.stats else None)
    np.save(args.out, logits)
    log.info("wrote %s: float32 %s", args.out, list(logits.shape))
    if args.stats:
        print(json.dumps({"stages": [s.as_dict() for s in stats]}, indent=2), file=sys.stderr)
    return 0


def _add_logits(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logits", help="write float32 logits for every position of a token id sequence",
                       description="Run the model on --ids and save float32 logits [T, vocab] (one row per "
                       "position) with numpy.save. The reference check against other implementations: fp32 on "
                       "CUDA disables TF32. --mode decode feeds one token at a time through the caches; "
                       "--stages N splits the layers into N in-process stages passing only the residual state.")
    p.add_argument("--model", type=model_arg, required=True, help=MODEL_HELP)
    p.add_argument("--ids", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--out", required=True, help="output .npy file")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="activation/compute dtype")
    p.add_argument("--mode", default="prefill", choices=["prefill", "decode"])
    p.add_argument("--stages", type=int, default=1, help="number of in-process stages (default 1)")
    p.add_argument("--eps", default="hf", choices=["hf", "llama.cpp"],
                   help="the two epsilons the references disagree on (MLA LoRA norms, KDA q/k L2 norm): 1e-6 as "
                   "the HF/fla code (default) or rms_norm_eps as llama.cpp")
    p.add_argument("--stats", action="store_true", help="print each stage's counters (JSON) to stderr")
    add_stage_options(p, sequences=1)
    p.set_defaults(func=_cmd_logits)


def _cmd_tokenize(args: argparse.Namespace) -> int:
    tok = K3Tokenizer.load(args.model)
    if not args.chat:
        print(json.dumps(tok.encode(args.text, allow_special=args.allow_special)))
        return 0
    try:
        messages = json.loads(args.text)
    except ValueError as e:
        raise DeltafinError(f"with --chat, TEXT must be a JSON list of messages: {e}") from None
    if not isinstance(messages, list):
        raise DeltafinError("with --chat, TEXT must be a JSON list of messages")
    options = ChatOptions(thinking=args.thinking != "off", effort=None if args.thinking in ("off", "none") else
                          args.thinking)
    print(json.dumps(encode(tok, messages, options)))
    return 0


def _cmd_detokenize(args: argparse.Namespace) -> int:
    text = args.ids.strip()
    try:
        ids = json.loads(text) if text.startswith("[") else [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ids = None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise DeltafinError(f"IDS must be a JSON list or comma-separated token ids, got {args.ids!r}")
    print(K3Tokenizer.load(args.model).decode(ids, skip_special=args.skip_special))
    return 0


def _add_tokenize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenize", help="print the token ids of a text (or of a chat) as a JSON list",
                       description="Encode TEXT with the model's tokenizer and print the ids as a JSON list. "
                       "Special-token text is ordinary text unless --allow-special. With --chat, TEXT is a JSON "
                       "list of messages rendered in K3's chat format, with the generation prompt.")
    p.add_argument("--model", type=model_arg, required=True, help=MODEL_HELP)
    p.add_argument("--chat", action="store_true", help="TEXT is a JSON list of chat messages")
    p.add_argument("--thinking", default="max", choices=["low", "high", "max", "none", "off"],
                   help="--chat: thinking effort; none: thinking without the effort message; off: no thinking")
    p.add_argument("--allow-special", action="store_true", help="encode special-token text as the special ids")
    p.add_argument("text", metavar="TEXT")
    p.set_defaults(func=_cmd_tokenize)
    d = sub.add_parser("detokenize", help="print the text of token ids",
                       description="Decode IDS (a JSON list or comma-separated ids); invalid UTF-8 becomes U+FFFD.")
    d.add_argument("--model", type=model_arg, required=True, help=MODEL_HELP)
    d.add_argument("--skip-special", action="store_true", help="leave special tokens out")
    d.add_argument("ids", metavar="IDS")
    d.set_defaults(func=_cmd_detokenize)


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="an interactive chat in the terminal (cluster or --local)",
                       description="Chat with the model in K3's chat format: reasoning is shown dimmed, then the "
                       "answer. Type /help for commands; Ctrl-C stops a reply, Ctrl-D or /exit quits.")
    terminal_chat.add_arguments(p)
    p.set_defaults(func=lambda args: asyncio.run(terminal_chat.run_chat(args)))


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job: k3-mini (a small K3 trained on Python's documentation, bundled) "
                       "on a local one-worker cluster",
                       description="Start a deltafin-worker on 127.0.0.1 with k3-mini, the small K3 that ships with "
                       "Deltafin (or --preset tiny|small: a synthetic K3 with random weights, written once into the "
                       "cache directory), connect to it over gRPC as a one-worker cluster and stream a chat reply.")
    demo.add_arguments(p)
    p.set_defaults(func=lambda args: asyncio.run(demo.run_demo(args)))


def _add_serve(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("serve", add_help=False, help="the one-machine server: the HTTP APIs (OpenAI, Anthropic, Ollama, "
                   "OpenAI Responses) and the web chat on this machine alone, k3-mini unless --model says (`deltafin "
                   "serve --help` for its options)")  # (main hands its arguments to serve's own parser)


def serve(argv: list[str]) -> int:
    """`deltafin serve ARGS`: `deltafin-coordinator --local serve ARGS`, the bundled model unless --model says."""
    from deltafin.cli.coordinator import serve_main  # grpc and the HTTP stack: loaded when it runs

    return serve_main(argv)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_synth, _add_inspect, _add_download, add_convert_command, _add_logits, add_bench_command, _add_tokenize,
    _add_chat, _add_demo, _add_serve, add_models_command, lambda sub: add_doctor_command(sub, model_arg, MODEL_HELP)]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="deltafin", description="Run Kimi K3 on machines you own.")
    parser.add_argument("--version", action="version", version=f"deltafin {__version__}")
    add_logging_options(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    for command in sub.choices.values():  # and after any command's name as well
        add_logging_options(command, after_command=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    at = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))  # the command's name
    if argv[at:at + 1] == ["serve"]:  # (the options before it are -q/-v, which serve's parser takes too)
        return serve(argv[:at] + argv[at + 1:])
    args = build_parser().parse_args(argv)
    setup_logging(log_level(args))
    return run_cli(lambda: args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
