"""k3-mini's recipe from the command line (deltafin/mini/recipe.py):

    python tools/k3_mini.py prepare --out .mini-data              # corpus, vocabulary, train.npy (CPU, ~1 min)
    python tools/k3_mini.py train --data .mini-data --out deltafin/assets/k3-mini --device cuda

The shipped model (deltafin/assets/k3-mini) was made by exactly these two commands with the defaults.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import fields
from pathlib import Path

from deltafin.mini import recipe
from deltafin.mini.train import TrainConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="corpus, vocabulary and training stream from this Python's stdlib")
    pp.add_argument("--out", type=Path, required=True)
    pp.add_argument("--seed", type=int, default=0)
    pt = sub.add_parser("train", help="train from prepare's output and export the checkpoint")
    pt.add_argument("--data", type=Path, required=True)
    pt.add_argument("--out", type=Path, required=True)
    pt.add_argument("--device", default="cuda")
    for f in fields(TrainConfig):
        pt.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.cmd == "prepare":
        print(json.dumps(recipe.prepare(args.out, args.seed), indent=1))
    else:
        tc = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
        history = recipe.train_model(args.data, args.out, tc, args.device)
        print(json.dumps(history[-1]))


if __name__ == "__main__":
    main()
