"""What the model runs on, as ClusterOptions say (cluster_options.py): in-process stages (single-machine mode) or
the workers, planned and assigned, behind one Backend.

The command line builds ClusterOptions from its flags (deltafin/cli/flags.py), the Python API from keywords;
both build the stages' StageOptions beside it, and `open_backend` takes the two.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from deltafin.checkpoint.config import ModelConfig
from deltafin.checkpoint.shards import open_checkpoint, scan_checkpoint
from deltafin.coordinator.cluster.backend import Backend, LocalBackend
from deltafin.coordinator.cluster.cluster_options import ClusterOptions
from deltafin.coordinator.cluster.recovery import RecoveryOptions, connect_cluster
from deltafin.coordinator.cluster.worker_client import Timeouts
from deltafin.coordinator.cluster.workers import ClusterSpec
from deltafin.devices import resolve_device
from deltafin.errors import DeltafinError
from deltafin.kernels.linear import select_kernels
from deltafin.plan.cluster.cluster_plan import ClusterPlan, describe_forwards
from deltafin.plan.outlook import copy_expert_bytes, mode_lines
from deltafin.plan.planner import split_layers
from deltafin.runtime.pipeline import LocalPipeline, plan_stages
from deltafin.runtime.stage_options import AssignmentOptions, StageOptions, with_memory_found
from deltafin.transport.auth import ClusterSecurity, load_key
from deltafin.weights.reader import layer_spans

log = logging.getLogger(__name__)



async def open_backend(cluster: ClusterOptions, stage: StageOptions, cfg: ModelConfig,
                       show_progress: bool = True) -> Backend:
    """The backend the command runs on: in-process stages with `cluster.local`, else the workers."""
    if cluster.local:
        select_kernels(stage.kernels)  # this process's kernels, before its stages load
        options = with_memory_found(stage, resolve_device(cluster.device))
        pipe = await asyncio.to_thread(LocalPipeline.load, cluster.model, cluster.local_stages, cluster.device,
                                       options.dtype, "hf", options, show_progress, cfg)
        return LocalBackend(pipe)
    backend, plan = await connect_cluster(cluster_spec(cluster, stage, cfg), show_progress=show_progress,
                                          recovery=RecoveryOptions(enabled=cluster.recovery,
                                                                   rejoin_interval=cluster.rejoin_interval,
                                                                   journal_tokens=cluster.replay_journal_tokens),
                                          cfg=cfg)
    say_plan(plan, show_progress)
    return backend


def say_plan(plan: ClusterPlan, show: bool) -> None:
    """A plan as a command shows it before its work: a line (unless -q), the whole of it in the debug log (-v)."""
    if show:
        print(plan.summary(), file=sys.stderr)
    log.debug("the plan:\n%s", plan.table())


def local_plan(cluster: ClusterOptions, stage: StageOptions, cfg: ModelConfig) -> str:
    """What `open_backend` loads in this process with `cluster.local`, planned the same way (nothing is loaded):
    each stage's memory by part, why its spine format, and what a forward carries."""
    device = resolve_device(cluster.device)
    options = with_memory_found(stage, device)
    ckpt = open_checkpoint(cluster.model, cfg)
    lines, experts = [], 0
    for z in plan_stages(ckpt, split_layers(cfg, cluster.local_stages), device, options):  # as open_backend does
        experts += sum(cfg.is_moe(i) for i in range(z.start, z.end)) * cfg.num_experts if z.streaming else 0
        lines.append(f"layers {z.start}-{z.end - 1} on {device.type} (this process): "
                     f"{len(z.resident_layers)} resident, {len(z.streamed_layers)} streamed; "
                     f"{describe_forwards(z)}, {z.sequences} sequence(s) of {z.context:,} tokens; "
                     f"{z.describe()}")
    copies = [("this process", experts * copy_expert_bytes(cfg, stage.mode.low_bit))] if stage.mode.low_bit else []
    return "\n".join([*lines, *mode_lines(cfg, stage.mode, copies)])


def cluster_spec(cluster: ClusterOptions, stage: StageOptions, cfg: ModelConfig) -> ClusterSpec:
    """How to find the workers and what to ask of them: the stage options every assignment carries (the plan
    adds each stage's budgets) and the sizing the planner plans each stage by."""
    if stage.expert_dir:
        raise DeltafinError("--expert-dir is a disk of this machine: give it to each deltafin-worker (or use --local)")
    security = ClusterSecurity(load_key(cluster.cluster_key, cluster.cluster_key_file), cluster.tls)
    timeouts = Timeouts(forward=cluster.forward_timeout, lost_after=cluster.worker_timeout,
                        probe_interval=min(2.0, cluster.worker_timeout / 3), reconnect=cluster.reconnect_timeout)
    sizing = stage.sizing_for(cfg, layer_spans(scan_checkpoint(cluster.model, cfg)))
    return ClusterSpec(Path(cluster.model), addresses=list(cluster.worker), discover=cluster.discover,
                       discover_timeout=cluster.discover_timeout, expect=cluster.expect,
                       interfaces=None if cluster.interface is None else list(cluster.interface),
                       options=AssignmentOptions.of(stage), sizing=sizing, act_bytes=stage.act_bytes,
                       memory_cap=stage.memory_bytes, timeouts=timeouts, security=security,
                       experts=cluster.experts, hops=cluster.hops)

