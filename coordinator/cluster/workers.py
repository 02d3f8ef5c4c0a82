"""Finding workers, checking them, planning the layers over them and loading the plan.

Workers come from Bonjour (browse with a timeout) and/or `--worker host:port`. Each is asked for its
Info: protocol version and model fingerprint must match the coordinator's, or it is left out with a
warning. The planner (deltafin/plan/planner.py) then splits the layers; every stage is assigned in parallel,
with progress, and the stages are handed back as a ResilientCluster (recovery.py), which re-plans and
replays when a worker fails.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from deltafin.checkpoint.config import ModelConfig
from deltafin.checkpoint.shards import fingerprint
from deltafin.coordinator.cluster.backend import ClusterBackend
from deltafin.coordinator.cluster.link_probe import LinkProbe
from deltafin.coordinator.cluster.worker_client import Timeouts, WorkerClient
from deltafin.errors import ClusterError, DeltafinError, RemoteError
from deltafin.options import EXPERT_PLACEMENTS
from deltafin.plan.cluster.cluster_plan import ClusterPlan, PlannedStage, WorkerCapacity
from deltafin.plan.cluster.expert_placement import ExpertPlacement, Holder, HolderLink
from deltafin.plan.memory.sizing import SizingInput
from deltafin.plan.modes import choose_mode
from deltafin.plan.outlook import Replan
from deltafin.plan.timing.hops import direct_hops
from deltafin.progress import Progress
from deltafin.runtime.prefix_store import PrefixBudget
from deltafin.runtime.stage_options import AssignmentOptions
from deltafin.transport.auth import ClusterSecurity
from deltafin.transport.discovery import browse, nobody_answered
from deltafin.transport.protocol import DEFAULT_MAX_MESSAGE, PROTOCOL_VERSION, version_gap
from deltafin.transport.worker_info import WorkerDescription

log = logging.getLogger(__name__)


@dataclass
class ClusterSpec:
    """How to find workers and what to ask of them."""

    model_dir: Path
    addresses: list[str] = field(default_factory=list)  # --worker host:port
    discover: bool = True
    discover_timeout: float = 3.0
    expect: int | None = None  # stop browsing once this many answered
    interfaces: list[str] | None = None
    options: AssignmentOptions = field(default_factory=AssignmentOptions)  # asked of every assigned stage
    sizing: SizingInput = field(default_factory=SizingInput)  # how the planner sizes each stage
    act_bytes: int = 4  # activation element size (fp32)
    memory_cap: int | None = None  # --memory-gb: no worker's stage plans for more than this
    timeouts: Timeouts = field(default_factory=Timeouts)
    security: ClusterSecurity = field(default_factory=ClusterSecurity)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE
    experts: str = "auto"  # wide | local | auto: whichever the plan predicts faster, with more than one worker
    hops: str = "auto"  # relay | direct | auto: how stage hops go (plan/timing/hops.py)
    probe: LinkProbe = field(default_factory=LinkProbe)  # the links measured so far (kept across re-plans)


Worker = tuple[WorkerClient, WorkerDescription]


async def discover_addresses(spec: ClusterSpec, timeout: float | None = None) -> list[str]:
    """The named addresses, plus those Bonjour finds (when discovery is on)."""
    addresses = list(spec.addresses)
    if spec.discover:
        found = await asyncio.to_thread(browse, timeout or spec.discover_timeout, spec.interfaces, spec.expect)
        addresses += [d.address for d in found if d.address not in addresses]
    return addresses


async def probe_workers(spec: ClusterSpec, addresses: list[str], quiet: bool = False,
                        timeout: float | None = None) -> list[Worker]:
    """Connect to each address and keep the workers that answer, run this model and this protocol, and
    accept this coordinator's key; the others are left out with a warning. With `quiet` (the probes of
    recovery and rejoin, repeated while a worker is away), a worker that does not answer is a debug line,
    and a refusal (credentials, protocol, model) a warning the first time it is seen."""
    mine = fingerprint(spec.model_dir)
    clients = [WorkerClient(a, timeouts=spec.timeouts, security=spec.security,
                            max_message_bytes=spec.max_message_bytes) for a in addresses]
    infos = await asyncio.gather(*(c.info(timeout) for c in clients), return_exceptions=True)
    usable = []

    def say(message: str, *args: Any) -> None:
        if not quiet:
            log.warning(message, *args)
        elif (text := message % args) not in _REFUSALS_SEEN:
            _REFUSALS_SEEN.add(text)
            log.warning(text)

    for client, info in zip(clients, infos, strict=True):
        if isinstance(info, RemoteError) and info.code in (grpc.StatusCode.UNAVAILABLE,
                                                           grpc.StatusCode.DEADLINE_EXCEEDED) and quiet:
            log.debug("leaving out %s: %s", client.address, info)
        elif isinstance(info, RemoteError):
            if info.code == grpc.StatusCode.UNAUTHENTICATED:
                say("leaving out %s: it refused this coordinator's credentials (%s)", client.address, info.details)
            else:
                say("leaving out %s: %s", client.address, info)
        elif isinstance(info, BaseException):
            await asyncio.gather(*(c.close() for c in clients))
            raise info
        elif info.protocol_version != PROTOCOL_VERSION:
            say("leaving out %s: %s", info.name, version_gap(info.name, info.protocol_version))
        elif info.model_fingerprint != mine:
            say("leaving out %s: it holds checkpoint %s, this coordinator %s (%s)", info.name,
                info.model_fingerprint, mine, spec.model_dir)
        else:
            usable.append((client, info))
            continue
        await client.close()
    return await spec.probe.fastest(usable, lambda address: WorkerClient(
        address, timeouts=spec.timeouts, security=spec.security, max_message_bytes=spec.max_message_bytes))


_REFUSALS_SEEN: set[str] = set()  # refusals already warned about by quiet probes


async def find_workers(spec: ClusterSpec) -> list[Worker]:
    """Connect to every named and discovered worker that runs this model; warn about the others."""
    addresses = await discover_addresses(spec)
    if not addresses:
        raise ClusterError(nobody_answered(spec.discover_timeout))
    usable = await probe_workers(spec, addresses)
    if not usable:
        raise ClusterError("no usable workers: every one found was unreachable, runs another model or protocol, or "
                           "refused this coordinator's key (see warnings)")
    return usable


def capacities(workers: list[Worker], memory_cap: int | None = None) -> list[WorkerCapacity]:
    """What the planner knows of each worker; `memory_cap` (--memory-gb) lowers every budget to it."""
    cap = (lambda m: m) if memory_cap is None else (lambda m: min(m, memory_cap))
    return [WorkerCapacity(d.name, cap(d.memory_bytes), d.disk_gbps, d.layers, d.has_top, d.address,
                           device=d.device.split(":")[0], host_memory_bytes=d.host_memory_bytes or None,
                           worker_id=d.key, expert_layers=d.expert_ranges, expert_gbps=d.expert_speed,
                           disks=d.expert_disks, damaged=d.damaged, spine=d.spine, spine_disk=d.spine_disk,
                           compute=d.compute)
            for _, d in workers]


async def plan_cluster(spec: ClusterSpec, cfg: ModelConfig, workers: list[Worker]) -> ClusterPlan:
    """The layers over the workers, priced with the links measured to and between them (link_probe.py); with
    `--experts auto` and more than one worker, wide or local experts, whichever the plan predicts faster
    (plan/modes.py), and why."""
    if spec.experts not in EXPERT_PLACEMENTS:
        raise DeltafinError(f"unknown --experts {spec.experts!r}: use {', '.join(EXPERT_PLACEMENTS)}")
    caps = capacities(workers, spec.memory_cap)
    links = await spec.probe.links(workers, pairs=len(workers) > 1)  # pairs: the hops and the wide calls
    links = replace(links, value_bytes=2 if spec.options.wire == "bf16" else 4,  # what crosses them, and how
                    hops=spec.hops)
    plan = choose_mode(cfg, caps, spec.sizing, spec.act_bytes, spec.experts, links)
    log.debug("plan (%s experts, %d workers answered):\n%s", "wide" if plan.wide else "local", len(workers),
              plan.table())
    return plan


def replanner(spec: ClusterSpec, cfg: ModelConfig, workers: list[Worker], plan: ClusterPlan) -> Replan:
    """The plan of `workers` made again as `plan_cluster` made `plan` (its links, the same mode rule), with other
    options and each worker's memory scaled: what `plan` prints of a longer context or more memory."""
    caps = capacities(workers, spec.memory_cap)

    def again(sizing: SizingInput, scale: float) -> ClusterPlan:
        scaled = [replace(c, memory_bytes=int(c.memory_bytes * scale), host_memory_bytes=None if
                                      c.host_memory_bytes is None else int(c.host_memory_bytes * scale)) for c in caps]
        return choose_mode(cfg, scaled, sizing, spec.act_bytes, spec.experts, plan.links)

    return again


def wide_placement(spec: ClusterSpec, plan: ClusterPlan) -> ExpertPlacement | None:
    """The wide part of a plan as every worker receives it (None: local experts)."""
    if plan.experts is None:
        return None
    members = plan.workers
    holders = tuple(Holder(s.key, s.address, s.worker, s.expert_gbps or s.disk_gbps,
                           s.compute.expert_one_s if s.compute else 0.0, s.compute.expert_token_s if s.compute else 0.0)
                    for s in members)
    flows = len(members) - 1  # a stage's calls go to every other holder at once: on one medium, they share it
    links = tuple(HolderLink(a.key, b.key, plan.links.sharing(plan.links.between(a.key, b.key), flows))
                  for i, a in enumerate(members) for b in members[i + 1:])
    t = spec.timeouts
    return ExpertPlacement(plan.experts, holders, t.probe_interval, t.lost_after, t.forward, links)


async def assign_plan(spec: ClusterSpec, cfg: ModelConfig, workers: list[Worker], show_progress: bool = True,
                      ) -> tuple[ClusterBackend, ClusterPlan]:
    """Plan the layers over `workers` and load every stage (in parallel, with progress). Workers the plan
    does not use are closed; on failure every client is closed. Every worker is sent its assignment; one already
    serving exactly that (the same layers and options: a re-plan that left it alone) keeps its stage and its
    caches, and with wide experts its store when only the placement changed (runtime/assigned.py)."""
    try:
        plan = await plan_cluster(spec, cfg, workers)
    except DeltafinError:
        await asyncio.gather(*(c.close() for c, _ in workers))
        raise
    by_key = {d.key: (c, d) for c, d in workers}  # names need not be unique (two workers on one host)
    used = [by_key[s.key] for s in plan.workers]
    for client, _ in workers:
        if client not in [c for c, _ in used]:
            await client.close()
    mine = fingerprint(spec.model_dir)
    wide = wide_placement(spec, plan)

    def label(s: PlannedStage) -> str:
        return f"load {s.worker} " + ("expert share" if s.plan.holder_only else f"layers {s.start}-{s.end - 1}")

    bars = {id(c): Progress(1.0, label(s), unit="", enabled=show_progress)
            for s, (c, _) in zip(plan.workers, used, strict=True)}

    def progress(client: WorkerClient, message: str, fraction: float) -> None:
        bar = bars.get(id(client))
        if bar is not None:
            bar.update(max(0.0, fraction - bar.done))

    todo = [c.assign(s.start, s.end, mine, spec.options, s.plan, progress, wide)
            for s, (c, _) in zip(plan.workers, used, strict=True)]
    try:
        await asyncio.gather(*todo)
    except BaseException:
        await asyncio.gather(*(c.close() for c, _ in used))
        raise
    finally:
        for bar in bars.values():
            bar.close()
    stages = [c for c, _ in used[:len(plan.stages)]]
    told = {(c.start, c.end): c for c in stages}
    prefixes = [PrefixBudget(s.start, s.end, s.plan.prefixes, spec.act_bytes, told[s.start, s.end].prefix_disk,
                             s.plan.context, told[s.start, s.end].identity)
                for s in sorted(plan.stages, key=lambda s: s.start)]
    route = functools.lru_cache(maxsize=64)(lambda tokens: direct_hops(cfg, plan, tokens, spec.act_bytes))
    return ClusterBackend(stages, forward_limit(spec, cfg, plan), prefixes,
                          parallel_stages([d for _, d in used[:len(plan.stages)]]),
                          holders=[c for c, _ in used[len(plan.stages):]], context=plan.context, route=route), plan


def parallel_stages(workers: list[WorkerDescription]) -> int:
    """Stages that can compute at once: one per worker, but CPU workers on one host share its cores, so they
    count once (two CPU workers on 2 cores with a batch each ran 2-4x slower than with one batch between them;
    workers sharing one GPU did gain, docs/serving.md, Serving at K3 scale)."""
    return len({(d.address.rsplit(":", 1)[0], "cpu") if d.device.split(":")[0] == "cpu" else d.key
                for d in workers})


def forward_limit(spec: ClusterSpec, cfg: ModelConfig, plan: ClusterPlan) -> int:
    """Tokens one forward carries: what every stage was sized for, a prompt's forward borrowing the expert cache where
    its plan lends it (sizing.py `_lend_cache`; a forward larger than a gRPC message goes in parts, not in pieces:
    worker_client.WorkerClient.forward)."""
    return min(s.plan.longest_forward for s in plan.stages)
