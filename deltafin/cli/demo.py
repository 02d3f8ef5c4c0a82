"""`deltafin demo`: the whole product on one machine, with nothing to download.

1. The model: k3-mini (default), a small K3 trained on Python's documentation that ships with the package
   (paths.bundled_model, deltafin/mini/); or, with `--preset tiny|small`, a synthetic K3 (exact K3 layout,
   random weights) written once into the cache ($DELTAFIN_CACHE, else $XDG_CACHE_HOME/deltafin, else
   ~/.cache/deltafin) and reused afterwards.
2. A real `deltafin-worker` process starts on 127.0.0.1 (no Bonjour announcement).
3. The coordinator connects to it over gRPC as a one-worker cluster, plans, assigns the stage, and
   generates a chat reply, streaming tokens and printing the stats line.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from deltafin import paths
from deltafin.checkpoint.config import load_config
from deltafin.coordinator.engine.generation import Generation
from deltafin.errors import DeltafinError
from deltafin.mini.synth import synthesize
from deltafin.text.chat import ChatOptions, OutputParser, encode
from deltafin.text.tokenizer import K3Tokenizer

log = logging.getLogger(__name__)

DEFAULT_PROMPT = "What does `json.dumps` do?"
TRAINED = "k3-mini"
LISTENING = re.compile(r"listening on ([\d.]+):(\d+)")
COMPLETE = ".deltafin-complete"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens to generate (default 96)")
    p.add_argument("--preset", default=TRAINED, choices=[TRAINED, "tiny", "small"],
                   help="k3-mini (default): the small K3 trained on Python's documentation that ships with Deltafin; "
                   "tiny, small: a synthetic K3 with random weights (random text)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights (default 0; not k3-mini)")
    p.add_argument("--cache-dir", default=None, help="where the checkpoint is kept (default: $DELTAFIN_CACHE, else "
                   "$XDG_CACHE_HOME/deltafin, else ~/.cache/deltafin)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"], help="the worker's device")


def cache_dir(explicit: str | None = None) -> Path:
    return Path(explicit) if explicit else paths.cache_dir()


def ensure_checkpoint(preset: str, seed: int, root: Path) -> Path:
    """The cached synthetic checkpoint, written on first use (into a temporary directory, then renamed,
    so an interrupted write never leaves a half checkpoint behind)."""
    target = root / f"synthetic-k3-{preset}-seed{seed}"
    if (target / COMPLETE).is_file():
        print(f"using the cached checkpoint {target}", file=sys.stderr)
        return target
    root.mkdir(parents=True, exist_ok=True)
    print(f"writing a synthetic K3 checkpoint ({preset}, random weights) to {target} (once)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        synthesize(preset, tmp, seed=seed, show_progress=True)
        (tmp / COMPLETE).write_text("written by deltafin demo\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


class LocalWorker:
    """A deltafin-worker subprocess on 127.0.0.1; its log goes to a file, shown if it fails."""

    def __init__(self, model: Path, device: str):
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in stop())
            "w+", prefix="deltafin-demo-worker-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "deltafin.cli.worker", "--model", str(model), "--host", "127.0.0.1",
               "--port", "0", "--no-announce", "--name", "demo-worker", "--device", device]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout: float = 300.0) -> str:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            m = LISTENING.search(line)
            if m:
                return f"{m.group(1)}:{m.group(2)}"
            if not line and self.proc.poll() is not None:
                break
        raise DeltafinError(f"the local worker did not start; its log:\n{self.tail()}")

    def tail(self, n: int = 20) -> str:
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text().splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


async def _reply(engine: Any, prompt: str, max_tokens: int) -> None:
    """One chat reply, streamed to stdout, and its stats line on stderr."""
    from deltafin.coordinator.engine.events import Finished  # torch: loaded when the command runs
    from deltafin.coordinator.engine.report import (  # torch: loaded when the command runs
        format_summary,
        run_summary,
    )
    ids = encode(engine.tokenizer, [{"role": "user", "content": prompt}], ChatOptions())
    print(f"user: {prompt}\nassistant (thinking): ", end="", flush=True)
    finished, answering = None, False
    async for event in engine.run(ids, OutputParser(engine.tokenizer), Generation(max_tokens)):
        if event.delta.content and not answering:
            print("\nassistant: ", end="", flush=True)
            answering = True
        print(event.delta.reasoning + event.delta.content, end="", flush=True)
        if isinstance(event, Finished):
            finished = event
    print()
    assert finished is not None
    print(format_summary(run_summary(finished, await engine.worker_stats())), file=sys.stderr)


async def run_demo(args: argparse.Namespace) -> int:
    from deltafin.coordinator.cluster.connect import say_plan  # torch: loaded when the command runs
    from deltafin.coordinator.cluster.recovery import (
        connect_cluster,  # torch: loaded when the command runs
    )
    from deltafin.coordinator.cluster.workers import ClusterSpec  # torch: loaded when the command runs
    from deltafin.coordinator.engine.engine import Engine  # torch: loaded when the command runs
    if args.max_tokens < 1:
        raise DeltafinError("--max-tokens must be at least 1")
    trained, quiet = args.preset == TRAINED, args.quiet
    if args.verbose < 1:  # the reply, not the coordinator's progress: its plan and its log are behind -v
        logging.getLogger("deltafin").setLevel(logging.WARNING)
    model = paths.bundled_model() if trained else ensure_checkpoint(args.preset, args.seed, cache_dir(args.cache_dir))
    cfg = load_config(model)
    what = ("k3-mini, trained on Python's documentation (its answers read like Python's docs, often about the "
            "wrong function: it is 1/100,000 of K3's size)" if trained
            else f"synthetic '{args.preset}', RANDOM WEIGHTS: the output below is gibberish by design")
    print(f"model: Kimi K3 architecture, {cfg.num_layers} layers ({len(cfg.kda_layers)} KDA + {len(cfg.mla_layers)} "
          f"MLA), {cfg.num_experts} experts per layer, {cfg.experts_per_token} active; {what}.", file=sys.stderr)
    worker = LocalWorker(model, args.device)
    try:
        address = worker.wait_ready()
        print(f"worker: deltafin-worker on {address} (a one-worker cluster)", file=sys.stderr)
        backend, plan = await connect_cluster(ClusterSpec(model, addresses=[address], discover=False),
                                              show_progress=not quiet)
        say_plan(plan, not quiet)
        tokenizer = K3Tokenizer.load(model)
        engine = Engine(backend, tokenizer, cfg, model.name, prefix_cache=True)
        try:
            await _reply(engine, args.prompt, args.max_tokens)
        finally:
            await engine.close()
    finally:
        worker.stop()
    print(("" if trained else "The weights are random, so the text is too. ") + "With a real checkpoint: start "
          "deltafin-worker on each Mac, then deltafin-coordinator --model DIR serve (see README.md).", file=sys.stderr)
    return 0
