"""`deltafin convert`: a checkpoint's spine written once in a compact format (weights/spine_convert.py), in the format
asked for or the fewest bytes the model can use; or (`--experts FORMAT`) the routed experts of its layers (all, or
`--layers A-B`: a worker's) in a low-bit expert format, the copy an expert mode reads (weights/expert_copy.py)."""

from __future__ import annotations

import argparse
import json
import logging

from deltafin.checkpoint.config import load_config
from deltafin.cli.flags import MODEL_HELP, model_arg
from deltafin.download.fetch import parse_experts, parse_layers
from deltafin.errors import DeltafinError
from deltafin.formats import converted_spines, expert_format, low_bit_formats, spine_format
from deltafin.options import DEVICES
from deltafin.plan.memory.layer_table import unfit_spines

log = logging.getLogger("deltafin")


def _cmd_convert(args: argparse.Namespace) -> int:
    if args.experts is not None:
        if args.spine is not None or args.out is not None:
            raise DeltafinError("--experts converts the routed experts alone: leave out --spine and --out")
        print_expert_conversion(args.model, args.experts, args.layers, args.share, args.quiet, args.device)
    elif args.layers is not None or args.share is not None:
        raise DeltafinError("--layers and --share choose what an --experts conversion converts (a spine converts "
                            "whole)")
    else:
        print_conversion(args.model, args.spine, args.out, args.quiet, args.device)
    return 0


def print_expert_conversion(model: str, fmt: str, layers: str | None, share: str | None, quiet: bool,
                            device: str) -> None:
    from deltafin.checkpoint.shards import open_checkpoint  # torch: loaded when the command runs
    from deltafin.devices import resolve_device  # (see above)
    from deltafin.weights.expert_copy import copy_bytes, prepare_copy, whole_layers  # (see above)

    cfg = load_config(model)
    start, end = parse_layers(layers, cfg.num_layers)
    ckpt = open_checkpoint(model, cfg, strict=False)
    ckpt.raise_problems(layers=range(start, end), top=False)
    ids = parse_experts(share, cfg.num_experts) or (0, cfg.num_experts)
    want = {i: range(*ids) for i in whole_layers(cfg, range(start, end))}
    copy = prepare_copy(ckpt, fmt, want, progress=not quiet, device=resolve_device(device))
    experts = sum(len(r) for r in want.values())
    print(json.dumps({"experts": fmt, "dir": str(copy.root), "layers": f"{start}-{end - 1}", "moe_layers": len(want),
                      "bytes": copy_bytes(cfg, copy.fmt, experts), "bytes_stored": experts * cfg.bytes_per_expert}))


def print_conversion(model: str, spine: str | None, out: str | None, quiet: bool, device: str) -> None:
    from deltafin.devices import resolve_device  # torch: loaded when the command runs
    from deltafin.weights.spine_convert import convert_checkpoint  # torch: loaded when the command runs

    summary = convert_checkpoint(model, conversion_format(model, spine), out, progress=not quiet,
                                 device=resolve_device(device))
    print(json.dumps(summary))


def conversion_format(model: str, spine: str | None) -> str:
    """The format asked for, refused with why where the model's matrices leave it nothing to hold (plan/layer_table's
    unfit_spines); none asked: the fewest bytes the model can use, saying which were passed over and why."""
    unusable = unfit_spines(load_config(model))
    usable = [f for f in converted_spines() if f not in unusable]
    if spine in unusable:
        raise DeltafinError(f"{unusable[spine]}: convert it with --spine {usable[0]} (the same bytes)")
    if spine is None:
        spine = usable[0]
        for passed in converted_spines()[:converted_spines().index(spine)]:
            log.warning("%s: converting %s instead", unusable[passed], spine)
    return spine


def add_convert_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="write a checkpoint's spine once in a compact format "
                       f"({' or '.join(reversed(converted_spines()))})",
                       description="Quantize the non-expert weights (the spine) once and write them, checksummed, "
                       "into the cache directory (spines/<checkpoint>-<format>), never into the model directory; "
                       "worker, bench, logits and the coordinator's local stage then load them at the disk's speed. "
                       "An interrupted run resumes; files already there are checked and rebuilt if corrupt or "
                       "stale. A process whose plan needs a converted spine converts it by itself unless "
                       "--no-convert; this command does it ahead of time. Prints a JSON summary.")
    p.add_argument("--model", type=model_arg, required=True, help=MODEL_HELP)
    p.add_argument("--spine", default=None, choices=converted_spines(),
                   help="; ".join(f"{f}{' (default)' if i == 0 else ''}: {spine_format(f).summary}"
                                  for i, f in enumerate(converted_spines())) + " (quality of each in docs/k3-mini.md; "
                   "a model whose matrices a format cannot hold, such as q4 on a hidden size of no whole 64-value "
                   "groups, gets the next by default)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write here instead of the cache directory (then pass --spine-dir DIR to the processes "
                   "that load it)")
    p.add_argument("--experts", default=None, choices=low_bit_formats(), metavar="FORMAT",
                   help="convert the routed experts instead, into the cache directory's experts/<checkpoint>-FORMAT: "
                   "the copy an --expert-mode naming FORMAT reads (" + "; ".join(
                       f"{f}: {expert_format(f).summary}" for f in low_bit_formats()) + "); a worker converts its "
                   "own layers when it starts in such a mode unless --no-convert")
    p.add_argument("--layers", default=None, metavar="A-B",
                   help="with --experts: decoder layers A to B inclusive, as `plan` prints a stage (default: all)")
    p.add_argument("--share", default=None, metavar="K/N",
                   help="with --experts: of every MoE layer only share K of N equal contiguous shares of its experts, "
                   "or A-B: expert ids A to B inclusive (a wide worker's, as `deltafin download --experts` takes "
                   "them; default: all)")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="where the matrices are quantized (default auto: a GPU if there is one, many times faster "
                   "than the CPU)")
    p.set_defaults(func=_cmd_convert)
