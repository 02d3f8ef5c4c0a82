"""Single-machine mode: N in-process stages that hand each other only the residual state.

This is the baseline every cluster result is compared with: the coordinator's `--local` mode and
`deltafin logits --stages N` run through it, and a cluster must produce exactly what it produces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from pathlib import Path

import numpy as np
import torch

from deltafin.checkpoint.config import ModelConfig, load_config, with_eps_convention
from deltafin.checkpoint.shards import Checkpoint, open_checkpoint
from deltafin.devices import exact_fp32, resolve_device, resolve_dtype
from deltafin.errors import DeltafinError, OutOfMemory
from deltafin.models.pieces import PIECE_TOKENS
from deltafin.plan.memory.least import check_fits
from deltafin.plan.memory.sizing import Placement
from deltafin.plan.memory.stage_plan import Budget, StagePlan
from deltafin.plan.planner import split_layers
from deltafin.progress import Progress
from deltafin.runtime.features import Features, gather
from deltafin.runtime.stage import Stage
from deltafin.runtime.stage_build import disk_plan, expert_backend_for
from deltafin.runtime.stage_io import SeqInput, SeqOutput
from deltafin.runtime.stage_options import StageOptions
from deltafin.runtime.worker_stats import StageStats
from deltafin.weights.reader import layer_spans

# the hub's route for one forward: yields (stage index, its inputs), is sent that stage's outputs
Route = Generator[tuple[int, list[SeqInput]], list[SeqOutput], list[SeqOutput]]


def route(n_stages: int, batch: list[SeqInput], start: int = 0) -> Route:
    """One forward through `n_stages` stages in layer order, without the calls themselves: each sequence's
    residual state goes from one stage to the next, and the last stage's outputs are returned. In-process
    stages (LocalPipeline.forward) and workers (coordinator/cluster/backend.py, ClusterBackend.forward) drive it.
    `start`: the forward resumes at that stage, `batch` being its inputs (a hop that failed, retried)."""
    outputs: list[SeqOutput] = []
    features: list[Features] = [{} for _ in batch]  # every stage's answers to the draft features asked
    for i in range(start, n_stages):
        if i > start:
            batch = [b.carrying(o.state) for b, o in zip(batch, outputs, strict=True)]  # type: ignore[arg-type]
        outputs = yield i, batch
        gather([o.features for o in outputs], features)
    return [dataclasses.replace(o, features=f) for o, f in zip(outputs, features, strict=True)]


class LocalPipeline:
    def __init__(self, stages: list[Stage]):
        self.stages = stages
        self.config = stages[0].cfg

    @classmethod
    def load(cls, model_dir: str | Path, n_stages: int = 1, device: str = "auto", dtype: str = "fp32",
             eps_convention: str = "hf", options: StageOptions | None = None,
             show_progress: bool = False, config: ModelConfig | None = None) -> LocalPipeline:
        """Load the model as `n_stages` in-process stages; `options` (its dtype is replaced by `dtype`);
        `config`: the model's, when the caller has read it already."""
        cfg = with_eps_convention(config or load_config(model_dir), eps_convention)
        ckpt = open_checkpoint(model_dir, cfg)
        torch_dtype = resolve_dtype(dtype)
        if torch_dtype == torch.float32:
            exact_fp32()
        dev = resolve_device(device)
        opts = dataclasses.replace(options or StageOptions(), dtype=torch_dtype)
        plans = plan_stages(ckpt, split_layers(cfg, n_stages), dev, opts)  # every stage, before the first loads
        stages = []
        for z in plans:
            with Progress(1.0, f"load layers {z.start}-{z.end - 1}", unit="", enabled=show_progress) as bar:
                stages.append(Stage(ckpt, z.start, z.end, device=dev, options=opts, plan=z,
                                    progress=lambda _msg, fraction, bar=bar: bar.update(max(0.0, fraction - bar.done))))
        return cls(stages)

    @property
    def max_forward_tokens(self) -> int | None:
        """Tokens one forward may carry through every stage (None: no limit)."""
        limits = [s.max_forward_tokens for s in self.stages if s.max_forward_tokens is not None]
        return min(limits) if limits else None

    def forward(self, batch: list[SeqInput], all_logits: bool = False,
                progress: Callable[[float], None] | None = None,
                should_stop: Callable[[], bool] | None = None) -> list[SeqOutput]:
        """The batch through every stage; `progress(fraction of the model's layers done)` after each layer;
        `should_stop` asked between layers (Cancelled: the sessions of the stage that stopped are as before)."""
        hops = route(len(self.stages), batch)
        i, inputs = next(hops)
        layers = self.stages[-1].end
        while True:
            stage = self.stages[i]
            hop = None if progress is None else (lambda d, _n, at=stage.start: progress((at + d) / layers))
            try:
                i, inputs = hops.send(stage.forward(inputs, all_logits=all_logits, progress=hop,
                                                    should_stop=should_stop))
            except StopIteration as done:
                return done.value

    def release(self, session_id: str, keep_as: str | None = None, keep_length: int = 0) -> None:
        for stage in self.stages:
            stage.release(session_id, keep_as, keep_length)

    def close(self) -> None:
        for stage in self.stages:
            stage.close()


def plan_stages(ckpt: Checkpoint, ranges: list[tuple[int, int]], device: torch.device,
                options: StageOptions) -> list[StagePlan]:
    """The plan of each in-process stage of `ranges`, made once, before any weights load (each stage loads its own
    as it is): within the budget, or SizingError with the least a stage needs (plan/memory/least.py); following what the
    disk holds (stage_build.disk_plan). Several stages share one context where none was given (a request goes
    through all): the least of the longest each one's memory holds (plan/memory/context.py), at the shortest forward
    their plans chose, so that none plans a longer one in its room."""
    cfg, backend = ckpt.config, expert_backend_for(ckpt.config, device, options.mode)

    def plan(a: int, b: int, opts: StageOptions) -> StagePlan:
        try:
            return disk_plan(ckpt, a, b, device, opts, backend)
        except OutOfMemory:
            if opts.memory_bytes is not None:  # say the least it needs, where that is more than the budget
                place = Placement(device.type, opts.act_bytes, backend)
                check_fits(cfg, a, b, place, Budget(opts.memory_bytes, opts.host_memory_bytes),
                           opts.sizing_for(cfg, layer_spans(ckpt)))
            raise

    plans = [plan(a, b, options) for a, b in ranges]
    if options.sizing.context is not None or options.memory_bytes is None or len(ranges) < 2:
        return plans
    forward = options.sizing.prefill_chunk or min(z.forward_tokens for z in plans)
    shared = options.replace(context=min(z.context for z in plans), prefill_chunk=forward)
    return [plan(a, b, shared) for a, b in ranges]


def compute_logits(model_dir: str | Path, ids: list[int], *, device: str = "auto", dtype: str = "fp32",
                   mode: str = "prefill", stages: int = 1, eps_convention: str = "hf",
                   options: StageOptions | None = None, stats: list[StageStats] | None = None) -> np.ndarray:
    """Float32 logits [T, vocab] for every position of `ids`.

    prefill: all ids in one forward (chunked KDA, expanded MLA); decode: one token per forward through
    the caches (recurrent KDA, absorbed MLA). `stages` splits the layers into in-process stages.
    `eps_convention` picks the two disputed epsilons (see config.with_eps_convention); `options` how
    stages hold weights; `stats`, if given, receives each stage's counters."""
    if not ids:
        raise DeltafinError("--ids must name at least one token id")
    if mode not in ("prefill", "decode"):
        raise DeltafinError(f"unknown --mode {mode!r}: use prefill or decode")
    pipe = LocalPipeline.load(model_dir, stages, device=device, dtype=dtype, eps_convention=eps_convention,
                              options=options)
    try:
        t = torch.tensor(ids, dtype=torch.long)
        if mode == "prefill":  # in chunks a forward returning every position's logits takes (the same logits)
            step = min(pipe.max_forward_tokens or len(ids), PIECE_TOKENS)
            out = torch.cat([pipe.forward([SeqInput("logits", i, ids=t[i:i + step])], all_logits=True)[0].logits
                             for i in range(0, len(ids), step)])
        else:
            out = torch.cat([pipe.forward([SeqInput("logits", i, ids=t[i:i + 1])])[0].logits
                             for i in range(len(ids))])
        if stats is not None:
            stats.extend(stage.stats() for stage in pipe.stages)
        return out.float().cpu().numpy()
    finally:
        pipe.close()
