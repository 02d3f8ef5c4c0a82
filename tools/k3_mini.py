"""k3-mini's recipe from the command line (deltafin/mini/recipe.py):

    python tools/k3_mini.py prepare --out .mini-data              # corpus, vocabulary, train.npy (CPU, ~1 min)
    python tools/k3_mini.py train --data .mini-data --out deltafin/assets/k3-mini --device cuda
    python tools/k3_mini.py draft --data .mini-data     # its EAGLE-3 draft head (CPU, ~45 min on 2 cores)

The shipped model (deltafin/assets/k3-mini) was made by exactly these two commands with the defaults, and its
draft head (deltafin/assets/k3-mini/draft) by the third: it answers training prompts (never the bench's,
deltafin/cli/workload.py) with k3-mini, trains the head on those answers, and measures it on the bench's.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import fields
from pathlib import Path

from deltafin.cli.workload import WORKLOADS
from deltafin.mini import recipe
from deltafin.mini.draft import DraftTrainConfig
from deltafin.mini.train import TrainConfig
from deltafin.paths import bundled_model


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
    pd = sub.add_parser("draft", help="train k3-mini's EAGLE-3 draft head on its own answers (CPU)")
    pd.add_argument("--data", type=Path, required=True, help="prepare's output; the answers are cached in it")
    pd.add_argument("--model", type=Path, default=None, help="the target (default: the bundled k3-mini)")
    pd.add_argument("--out", type=Path, default=None, help="default: MODEL/draft")
    for f in fields(DraftTrainConfig):
        kind = (lambda v: tuple(int(x) for x in v.split(","))) if isinstance(f.default, tuple) else type(f.default)
        pd.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.cmd == "prepare":
        print(json.dumps(recipe.prepare(args.out, args.seed), indent=1))
    elif args.cmd == "draft":
        model = args.model or bundled_model()
        dc = DraftTrainConfig(**{f.name: getattr(args, f.name) for f in fields(DraftTrainConfig)})
        exclude = {q for prompts in WORKLOADS.values() for q in prompts}
        trained = recipe.train_draft(args.data, model, args.out or model / "draft", dc, exclude, WORKLOADS)
        print(json.dumps(trained["offline_acceptance"], indent=1))
    else:
        tc = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
        history = recipe.train_model(args.data, args.out, tc, args.device)
        print(json.dumps(history[-1]))


if __name__ == "__main__":
    main()
