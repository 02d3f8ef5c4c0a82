"""`deltafin models`: the models this machine has by name (the bundled k3-mini, and those under the cache
directory's models/, where `deltafin download` puts them), with what each holds and its conversions."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import id_ranges, scan_checkpoint
from deltafin.errors import DeltafinError
from deltafin.formats import converted_spines
from deltafin.paths import BUNDLED, known_models, models_dir


def describe(name: str, path: Path) -> dict[str, Any]:
    """One model: its bytes on disk (holes not counted), the layers whose every tensor it holds, the embedding
    and head, the spine conversions in the cache; or what is wrong with it."""
    row: dict[str, Any] = {"name": name, "path": str(path),
                           "disk_bytes": sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())}
    try:
        ckpt = scan_checkpoint(path, load_config(path))
    except DeltafinError as e:
        return {**row, "error": str(e)}
    cfg = ckpt.config
    row.update(layers=len(ckpt.layers_available()), of_layers=cfg.num_layers,
               held=id_ranges(ckpt.layers_available()), top=ckpt.top_available,
               problems=sum(p.damage for p in ckpt.problems), conversions=_conversions(path))
    return row


def _conversions(path: Path) -> list[str]:
    from deltafin.weights.spine_files import default_root, read_manifest  # torch: loaded when the command runs

    out = []
    for fmt in reversed(converted_spines()):
        try:
            manifest = read_manifest(default_root(path, fmt))
        except DeltafinError:
            manifest = {}
        if manifest is not None:
            units = len(manifest.get("units", {})) if manifest else 0
            out.append(f"{fmt} ({units} parts)")
    return out


_SHADOWED = f" (named {BUNDLED} too: --model {BUNDLED} is the bundled one, this one's path finds it)"


def _shown(row: dict[str, Any]) -> str:
    """A row's name in the table: a model found by its path alone (`paths.name_of`) shows none."""
    return "(by its path)" if row["name"] == row["path"] else row["name"]


def _cmd_models(args: argparse.Namespace) -> int:
    rows = [describe(name, path) for name, path in known_models()]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'name':<20} {'on disk':>9} {'layers':>9}  {'held':<16} {'top':<4} {'conversions':<24} path")
    for r in rows:
        size = f"{r['disk_bytes'] / 1e9:.2f} GB"
        if "error" in r:
            print(f"{_shown(r):<20} {size:>9}  {r['error']}")
            continue
        damaged = f", {r['problems']} damaged file(s): deltafin inspect --model {r['name']}" if r["problems"] else ""
        print(f"{_shown(r):<20} {size:>9} {r['layers']:>4} of {r['of_layers']:<3} {r['held']:<16} "
              f"{'yes' if r['top'] else 'no':<4} {', '.join(r['conversions']) or '-':<24} {r['path']}{damaged}"
              f"{_SHADOWED if _shown(r) != r['name'] else ''}")
    print(f"\n(--model NAME runs one of these; `deltafin download SOURCE` adds one to {models_dir()})")
    return 0


def add_models_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the models this machine has by name, with what each holds",
                       description="The bundled k3-mini and every model under the cache directory's models/ "
                       f"({models_dir()}), where `deltafin download` puts them: size on disk, the layers whose every "
                       "tensor is there, the embedding and head, converted spines. `--model NAME` finds them.")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_models)
