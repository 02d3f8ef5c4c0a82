"""The worker daemon: one pipeline stage (or a wide worker's share of every layer's experts) of a Kimi K3 checkpoint
served over gRPC, announced over Bonjour. `serve` indexes the model directory (which may hold only some layers),
refuses a memory budget no stage could use, measures the disk with the expert reader and the compute, announces
`_deltafin._tcp.local.` and waits for a coordinator to assign it a layer range; when told to stop it withdraws
the announcement and finishes or fails the calls in flight within the grace period. `deltafin-worker`
(deltafin/cli/worker.py) makes its WorkerOptions from the flags and runs it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import fingerprint, id_ranges, open_copy, scan_checkpoint
from deltafin.devices import resolve_device
from deltafin.errors import DeltafinError
from deltafin.kernels.linear import select_kernels
from deltafin.plan.memory.least import least_options, shortfall, smallest_stages
from deltafin.plan.memory.sizing import Placement
from deltafin.runtime.compute_probe import ComputeReadings, measure_compute
from deltafin.runtime.stage_options import StageOptions, with_memory_found
from deltafin.transport.auth import ClientTls, ClusterSecurity, ServerTls, load_key
from deltafin.transport.discovery import Announcer, interface_addresses
from deltafin.transport.ports import check_free
from deltafin.transport.worker_info import WorkerDescription, layer_ranges
from deltafin.version import __version__
from deltafin.weights.diskspeed import measure_disk
from deltafin.weights.reader import layer_spans
from deltafin.weights.spine_convert import spine_disk
from deltafin.worker.idle import SleepGuard, keep_awake, remeasure_compute
from deltafin.worker.service import WorkerService, create_server, expire_sessions
from deltafin.worker.worker_options import WorkerOptions

log = logging.getLogger("deltafin.worker")


def _security(worker: WorkerOptions) -> tuple[bytes | None, ServerTls | None, ClusterSecurity]:
    """The cluster key and TLS files, checked, and how this worker calls other workers (the same key; TLS when
    it serves TLS); a warning when a key-less worker listens beyond loopback."""
    key = load_key(worker.cluster_key, worker.cluster_key_file)
    tls = ServerTls(worker.tls_cert, worker.tls_key, worker.tls_client_ca) if worker.tls_cert else None
    peer_tls = (ClientTls(worker.tls_ca or worker.tls_client_ca, worker.tls_cert, worker.tls_key,
                          worker.tls_server_name) if worker.tls_cert else None)
    if peer_tls is not None:
        peer_tls.credentials()  # unreadable files fail now, with their names
    if key is None and not worker.loopback:
        log.warning("listening on %s WITHOUT a cluster key: anyone who can reach this port can load layers and "
                    "run forwards on this machine. Set --cluster-key (and --tls-cert) on a shared network.",
                    worker.host)
    return key, tls, ClusterSecurity(key, peer_tls)


def _disk_speeds(worker: WorkerOptions, ckpts: list[Any]) -> tuple[float, ...]:
    """GB/s of each disk (--model first, then each --expert-dir): given, or measured with the expert reader."""
    given = worker.given_disk_speeds(len(ckpts))
    if given is not None:
        return given
    return tuple(measure_disk(c, worker.stage.sizing.read_threads, worker.stage.io) for c in ckpts)


def _describe(worker: WorkerOptions, ckpts: list[Any], speeds: tuple[float, ...], device: Any,
              stage: StageOptions) -> WorkerDescription:
    """What this worker announces: its layers on disk (and the experts on every disk), memory budget, measured
    disk speeds and compute, a fresh id."""
    ckpt = ckpts[0]
    experts = sorted({i for c in ckpts for i in c.layers_available()})
    # a disk that holds no MoE layer reads no experts; speeds of the ones that do add up
    expert_gbps = sum(g for c, g in zip(ckpts, speeds, strict=True)
                      if any(ckpt.config.is_moe(i) for i in c.layers_available()))
    return WorkerDescription(name=worker.name or socket.gethostname(), address="", device=str(device),
                             memory_bytes=stage.memory_bytes, disk_gbps=speeds[0],
                             model_fingerprint=fingerprint(worker.model),
                             layers=layer_ranges(ckpt.layers_available()), has_top=ckpt.top_available,
                             version=__version__, host_memory_bytes=stage.host_memory_bytes or 0,
                             worker_id=uuid.uuid4().hex[:12], expert_layers=layer_ranges(experts),
                             expert_gbps=expert_gbps, expert_disks=len(ckpts),
                             damaged=tuple(_short(p) for p in damaged(ckpt)), spine=stage.sizing.spine,
                             spine_disk=spine_disk(ckpt, stage.spine_dir),
                             compute=measure_compute(ckpt.config, device, stage.torch_dtype))


def _checkpoints(worker: WorkerOptions) -> list[Any]:
    """--model indexed (every shard's size against its header, every tensor checked), then each --expert-dir (the
    same checkpoint, maybe only some of its shards). Damage is said once per file; those layers are not served."""
    ckpt = scan_checkpoint(worker.model, load_config(worker.model))
    if not ckpt.layers_available():
        raise DeltafinError(f"{worker.model} holds no complete layer: "
                            + "; ".join(p.message for p in ckpt.problems[:3]))
    for p in damaged(ckpt):
        log.warning("%s: %s", worker.model, p.message)
    if damaged(ckpt):
        log.warning("this worker serves layers %s, not %s (damaged above)", id_ranges(ckpt.layers_available()),
                    id_ranges(sorted({i for p in damaged(ckpt) for i in (p.layer, *p.layers) if i is not None})))
    return [ckpt, *(open_copy(ckpt, d) for d in worker.stage.expert_dir)]


def _short(problem: Any) -> str:
    """A damaged shard as a worker announces it: "FILE: its problem, in brief"."""
    name = next((w.rstrip(":,") for w in problem.message.split() if ".safetensors" in w), "a shard")
    layers = id_ranges(sorted({i for i in (problem.layer, *problem.layers) if i is not None}))
    return f"{name} is damaged (layers {layers}): copy or download it again"


def reached_at(host: str, port: int, advertised: list[str]) -> tuple[str, ...]:
    """The addresses this worker announces it is reached at, for a coordinator to choose the fastest from: the
    `advertised` ones where given, else each interface's IPv4 address where it listens on all of them, else none
    (it is reached where it was found)."""
    if advertised:
        return tuple(dict.fromkeys(advertised))
    return tuple(f"{ip}:{port}" for ip in interface_addresses()) if host in ("0.0.0.0", "::") else ()


def damaged(ckpt: Any) -> list[Any]:
    """The problems of damaged files on this worker's disk (not of shards it does not hold: a worker's share of
    a checkpoint leaves those out on purpose)."""
    return [p for p in ckpt.problems if p.damage]


def _check_budget(ckpts: list[Any], device: Any, options: StageOptions, source: str) -> None:
    """A budget in which not even the smallest stage this worker could be given plans (one of its layers alone, or
    an expert holder, with one sequence: plan/memory/least.py) is refused now, before the worker listens: no coordinator
    could use it, and more workers do not change what a stage needs."""
    ckpt, cfg = ckpts[0], ckpts[0].config
    place = Placement(device.type, options.act_bytes, "mlx" if device.type == "mps" else "torch")
    experts = sum(1 for i in cfg.moe_layers if any(i in c.layers_available() for c in ckpts))
    sizing = least_options(options.sizing_for(ckpt.config, layer_spans(ckpt)))
    stages = smallest_stages(cfg, place, sizing, ckpt.layers_available(), ckpt.top_available, experts)
    least = shortfall(stages, options.memory_bytes)
    if least is not None:
        raise DeltafinError(f"this worker's memory budget, {options.memory_bytes / 1e9:.2f} GB ({source}), is below "
                            f"the least any stage of this model needs on {device.type}: {least.describe()}. Give it "
                            "more memory; more workers do not help (every stage needs this much)")


async def serve(worker: WorkerOptions, stop: asyncio.Event, said: Callable[[str], None] = log.info) -> int:
    """Serve until `stop` is set, then withdraw the announcement and give the calls in flight `worker.grace` seconds;
    `said` hears the line that tells where it listens (the command prints it: scripts wait for it)."""
    if worker.port:  # before the shards are checked and the disk timed; gRPC's own refusal would log a C-core line too
        check_free(worker.host, worker.port, "this worker")
    key, tls, peer_security = _security(worker)
    ckpts = _checkpoints(worker)
    device = resolve_device(worker.device)
    select_kernels(worker.stage.kernels)
    stage = with_memory_found(worker.stage, device)  # the budget, found or given
    _check_budget(ckpts, device, stage, "--memory-gb" if worker.stage.memory_bytes is not None
                  else "found on this machine")
    speeds = _disk_speeds(worker, ckpts)
    stage = dataclasses.replace(stage, disk_gbps=speeds)
    desc = _describe(worker, ckpts, speeds, device, stage)
    service = WorkerService(ckpts[0], desc, device, stage, peer_security, worker.max_message)
    server, port = await create_server(service, worker.host, worker.port, worker.max_message, key, tls)
    tasks = _background(service, worker.session_ttl, stage)
    desc = dataclasses.replace(desc, address=f"{worker.host}:{port}",
                               addresses=reached_at(worker.host, port, list(worker.advertise)))
    service.description = desc
    # zeroconf's blocking API runs its own loop: keep it off ours
    announcer = (await asyncio.to_thread(Announcer, desc, worker.host, port, list(worker.interface or ()) or None)
                 if worker.announce else None)
    said(_listening(desc, f"{worker.host}:{port}", device, speeds))
    await stop.wait()
    for task in tasks:
        task.cancel()
    log.info("shutting down: withdrawing the announcement, %.0fs for calls in flight (a second signal exits now)",
             worker.grace)
    t0 = time.monotonic()
    if announcer is not None:
        await asyncio.to_thread(announcer.close)
    await service.health.enter_graceful_shutdown()
    await server.stop(worker.grace)
    await service.peers.close()
    await service.courier.close()
    await asyncio.to_thread(service.close)
    log.info("stopped in %.1fs", time.monotonic() - t0)
    return 0


def _listening(desc: WorkerDescription, where: str, device: Any, speeds: tuple[float, ...]) -> str:
    disks = f"disk{'s' * (len(speeds) > 1)} {' + '.join(f'{g:.2f}' for g in speeds)} GB/s"
    return (f"deltafin-worker {desc.name} listening on {where} (layers {desc.layers}, device {device}, "
            f"memory {desc.memory_bytes / 1e9:.1f} GB, {disks}, id {desc.worker_id})")


def _background(service: WorkerService, session_ttl: float, options: StageOptions) -> list[asyncio.Future]:
    """The worker's tasks beside its calls: idle sessions expired, compute measured again while idle
    (worker/idle.py), the Mac kept awake while it serves."""
    readings = ComputeReadings([service.description.compute])
    measure = partial(service.slot.on_stage_thread, measure_compute, service.ckpt.config, service.device,
                      options.torch_dtype, lambda: service.serving > 0)  # a call that comes in goes first
    announce = lambda speed: setattr(service, "description", dataclasses.replace(service.description, compute=speed))
    return [asyncio.ensure_future(expire_sessions(service, session_ttl)),
            asyncio.ensure_future(remeasure_compute(service, readings, measure, announce)),
            asyncio.ensure_future(keep_awake(service, SleepGuard(), os.getpid()))]
