"""Finding workers, checking them, planning the layers over them and loading the plan.

Workers come from Bonjour (browse with a timeout) and/or `--worker host:port`. Each is asked for its
Info: protocol version and model fingerprint must match the coordinator's, or it is left out with a
warning. The planner (deltafin/planner.py) then splits the layers; every stage is assigned in parallel,
with progress, and the stages are handed back as a ClusterBackend.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltafin.checkpoint import fingerprint
from deltafin.config import ModelConfig, load_config
from deltafin.errors import DeltafinError
from deltafin.planner import Plan, StagePlan, WorkerCapacity, plan_layers, working_bytes
from deltafin.progress import Progress
from deltafin.transport.codec import PROTOCOL_VERSION, WorkerDescription
from deltafin.transport.status import RemoteError

from .backend import ClusterBackend, Timeouts, WorkerClient

log = logging.getLogger(__name__)


class ClusterError(DeltafinError):
    pass


@dataclass
class ClusterSpec:
    """How to find workers and what to ask of them."""

    model_dir: Path
    addresses: list[str] = field(default_factory=list)  # --worker host:port
    discover: bool = True
    discover_timeout: float = 3.0
    expect: int | None = None  # stop browsing once this many answered
    interfaces: list[str] | None = None
    options: dict[str, Any] = field(default_factory=dict)  # stage options sent with every assignment
    spine: str = "bf16"
    timeouts: Timeouts = field(default_factory=Timeouts)


async def find_workers(spec: ClusterSpec) -> list[tuple[WorkerClient, WorkerDescription]]:
    """Connect to every named and discovered worker that runs this model; warn about the others."""
    addresses = list(spec.addresses)
    if spec.discover:
        from deltafin.discovery import browse

        found = await asyncio.to_thread(browse, spec.discover_timeout, spec.interfaces, spec.expect)
        addresses += [d.address for d in found if d.address not in addresses]
    if not addresses:
        raise ClusterError("no workers: none answered on Bonjour within "
                           f"{spec.discover_timeout:.0f}s and none was named with --worker host:port")
    mine = fingerprint(spec.model_dir)
    clients = [WorkerClient(a, timeouts=spec.timeouts) for a in addresses]
    infos = await asyncio.gather(*(c.info() for c in clients), return_exceptions=True)
    usable = []
    for client, info in zip(clients, infos, strict=True):
        if isinstance(info, RemoteError):
            log.warning("leaving out %s: %s", client.address, info)
        elif isinstance(info, BaseException):
            raise info
        elif info.protocol_version != PROTOCOL_VERSION:
            log.warning("leaving out %s: protocol %d, this coordinator speaks %d", info.name, info.protocol_version,
                        PROTOCOL_VERSION)
        elif info.model_fingerprint != mine:
            log.warning("leaving out %s: it holds checkpoint %s, this coordinator %s (%s)", info.name,
                        info.model_fingerprint, mine, spec.model_dir)
        else:
            usable.append((client, info))
            continue
        await client.close()
    if not usable:
        raise ClusterError("no usable workers: every one found runs another model or protocol (see warnings)")
    return usable


def capacities(workers: list[tuple[WorkerClient, WorkerDescription]]) -> list[WorkerCapacity]:
    return [WorkerCapacity(d.name, d.memory_bytes, d.disk_gbps, d.layers, d.has_top, d.address) for _, d in workers]


def stage_options(cfg: ModelConfig, stage: StagePlan, base: dict[str, Any], memory: int) -> dict[str, Any]:
    """Options for one stage: the user's, plus expert residency from the plan when the user set none."""
    options = dict(base)
    if "expert_cache_bytes" not in options:
        n_moe = sum(1 for i in range(stage.start, stage.end) if cfg.is_moe(i))
        experts = n_moe * cfg.num_experts * cfg.bytes_per_expert
        if stage.spine_bytes + experts + working_bytes(cfg) > memory:
            options["expert_cache_bytes"] = stage.cache_bytes  # stream them; the rest of memory caches
    return options


async def connect_cluster(spec: ClusterSpec, show_progress: bool = True) -> tuple[ClusterBackend, Plan]:
    cfg = load_config(spec.model_dir)
    workers = await find_workers(spec)
    plan = plan_layers(cfg, capacities(workers), spine=spec.spine)
    by_name = {d.name: (c, d) for c, d in workers}
    used = [by_name[s.worker] for s in plan.stages]
    for client, _ in workers:
        if client not in [c for c, _ in used]:
            await client.close()
    log.debug("plan:\n%s", plan.table())
    mine = fingerprint(spec.model_dir)
    bars = {s.worker: Progress(1.0, f"load {s.worker} layers {s.start}-{s.end - 1}", unit="",
                               enabled=show_progress) for s in plan.stages}

    def progress(client: WorkerClient, message: str, fraction: float) -> None:
        bar = bars.get(client.name)
        if bar is not None:
            bar.update(max(0.0, fraction - bar.done))

    try:
        await asyncio.gather(*(c.assign(s.start, s.end, mine, stage_options(cfg, s, spec.options, d.memory_bytes),
                                        progress)
                               for s, (c, d) in zip(plan.stages, used, strict=True)))
    except BaseException:
        await asyncio.gather(*(c.close() for c, _ in used))
        raise
    finally:
        for bar in bars.values():
            bar.close()
    return ClusterBackend([c for c, _ in used]), plan
