"""What a worker was assigned (an Assigned: a Stage, and with wide experts its share of every MoE layer's experts:
deltafin/runtime/assigned.py), the one thread that owns it, and the transaction that replaces it.

An Assign is checked first (`check_assignment`: the same checkpoint, options the command line would take, layers
and experts on this worker's disks; `check_fits`: the coordinator's plan of the stage, placed here as counted and
within this worker's budget, or where none was sent the plan this worker makes), so that a refused one leaves the old
assignment serving, then loaded on the stage's thread while its progress streams back (`AssignmentSlot.replace`). One
assignment loads at a time, handed what was held before; one whose caller goes away (cancelled, deadline) is
closed once its load ends, before the next one loads, so that two are never in memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.checkpoint.shards import Checkpoint
from deltafin.devices import exact_fp32
from deltafin.errors import CodecError, FingerprintMismatch, NotAssigned
from deltafin.plan.cluster.expert_placement import ExpertPlacement
from deltafin.plan.memory.sizing import Placement
from deltafin.plan.memory.stage_check import check_plan
from deltafin.plan.memory.stage_plan import Budget, StagePlan
from deltafin.runtime.assigned import Assigned, assign, wide_known
from deltafin.runtime.stage import Stage
from deltafin.runtime.stage_build import expert_backend_for, plan_stage
from deltafin.runtime.stage_options import StageOptions
from deltafin.transport import codec
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.transport.worker_info import WorkerDescription
from deltafin.weights.reader import layer_spans

log = logging.getLogger(__name__)


def check_assignment(request: pb.Assignment, description: WorkerDescription, cfg: ModelConfig,
                     defaults: StageOptions) -> tuple[StageOptions, StagePlan | None, ExpertPlacement | None]:
    """The options, the stage's plan (None: this worker plans it) and the expert plan of an assignment this worker
    can take (same checkpoint, layers and experts on its disks)."""
    if request.model_fingerprint != description.model_fingerprint:
        raise FingerprintMismatch(
            f"this worker holds checkpoint {description.model_fingerprint}, the coordinator "
            f"{request.model_fingerprint}: both must use the same model files")
    options = codec.decode_stage_options(request.options, defaults)
    plan = codec.decode_stage_plan(request.plan, cfg.num_layers) if request.HasField("plan") else None
    if plan is not None and (plan.start, plan.end) != (request.start, request.end):
        raise CodecError(f"the plan is for layers [{plan.start}, {plan.end}), the assignment for "
                         f"[{request.start}, {request.end})")
    own = defaults.sizing.spine
    asked = plan.spine if plan is not None else own
    if request.end > request.start and own != "auto" and asked != own:
        raise NotAssigned(f"this worker was started with --spine {own}, and the plan holds the spine as {asked}: "
                          f"start the coordinator with --spine {own} (or this worker with --spine auto)")
    experts = codec.decode_expert_placement(request.experts, cfg.num_experts) if request.HasField("experts") else None
    if request.end <= request.start and not (experts is not None and request.start == request.end == 0):
        raise NotAssigned(f"invalid layer range [{request.start}, {request.end}): only an expert holder of a "
                          "wide plan takes no layers")
    if not description.has_layers(request.start, request.end):
        raise NotAssigned(f"layers [{request.start}, {request.end}) are not all on this worker's disk "
                          f"(it has {description.layers})")
    if experts is not None and len(experts.holders) < 2:
        raise CodecError("a wide expert plan divides the experts among two holders or more (one worker computes "
                         "its own layers' experts: send no expert plan)")
    if experts is not None:
        index = experts.ranges.index(description.key)
        held = {i for a, b in description.expert_ranges for i in range(a, b)}
        missing = [layer for layer in (experts.ranges.layers_of(index) if index is not None else ())
                   if layer not in held]
        if missing:
            raise NotAssigned(f"the plan gives this worker experts of layers {missing[:8]} that are not on its "
                              f"disks (it has {description.expert_ranges})")
    return options, plan, experts


class AssignmentSlot:
    """What this worker holds and its state (idle, loading, ready, failed); `worker_key` says, when a load starts,
    which holder of a wide plan this worker is."""

    def __init__(self, ckpt: Checkpoint, device: torch.device, worker_key: Callable[[], str]) -> None:
        self.ckpt, self.device, self.worker_key = ckpt, device, worker_key
        self.assigned: Assigned | None = None
        self.state = "idle"
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="deltafin-stage")  # the stage's one owner
        self._lock = asyncio.Lock()
        self._orphan: asyncio.Future[None] | None = None  # closing what a cancelled Assign was loading

    @property
    def stage(self) -> Stage | None:
        return self.assigned.stage if self.assigned is not None else None

    async def on_stage_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def check_fits(self, start: int, end: int, options: StageOptions, plan: StagePlan | None,
                   experts: ExpertPlacement | None = None) -> StagePlan | None:
        """Refuse now (SizingError), while the old assignment still serves, a stage its budget cannot hold; the
        plan to load: the one sent, as placed here (plan/memory/stage_check.py), or None where the stage plans itself
        (checked now with the same pure plan it makes when it loads, for its part of `plan` if wide)."""
        cfg, spans = self.ckpt.config, layer_spans(self.ckpt)
        backend = expert_backend_for(cfg, self.device, options.mode)
        if plan is not None:
            place = Placement(self.device.type, options.act_bytes, backend)
            budget = Budget(options.memory_bytes, options.host_memory_bytes) if options.memory_bytes is not None \
                else Budget(plan.device_total)  # no budget of its own: the plan's
            return check_plan(cfg, plan, place, budget, options.sizing_for(cfg, spans))
        index = experts.ranges.index(self.worker_key()) if experts is not None else None
        if end > start:
            plan_stage(cfg, start, end, self.device, options, spans, backend,
                       wide_known(experts, index) if experts is not None and index is not None else None)
        return None

    async def replace(self, start: int, end: int, options: StageOptions, plan: StagePlan | None,
                      experts: ExpertPlacement | None, peers: dict[str, Any]) -> AsyncIterator[tuple[str, float]]:
        """Load layers [start, end) (and the experts `plan` gives this worker) in place of what is held, yielding
        the load's progress (message, fraction); raises what the load raised, in state "failed"."""
        async with self._lock:
            queue: asyncio.Queue = asyncio.Queue()
            loop = asyncio.get_running_loop()

            def progress(message: str, fraction: float) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, (message, fraction))

            if self._orphan is not None:  # a cancelled load is closed before another one starts
                await self._orphan
            old, self.assigned, self.state = self.assigned, None, "loading"
            task = asyncio.ensure_future(self.on_stage_thread(self.load, old, start, end, options, plan, experts,
                                                              peers, progress))
            try:
                while not task.done():
                    try:
                        message, fraction = await asyncio.wait_for(queue.get(), timeout=0.5)
                        yield message, fraction
                    except asyncio.TimeoutError:
                        continue
            except BaseException:  # the coordinator went away (cancelled, deadline): close what it was loading
                self.state = "idle"
                self._orphan = asyncio.ensure_future(self._close_when_loaded(task))
                raise
            try:
                self.assigned = task.result()
            except Exception:
                self.state = "failed"
                raise
            self.state = "ready"

    async def _close_when_loaded(self, task: asyncio.Future[Assigned]) -> None:
        try:
            loaded = await task
        except Exception as e:
            log.info("a cancelled assignment's load failed: %s", e)
            return
        await self.on_stage_thread(loaded.close)
        log.info("closed layers [%d, %d): their assignment was cancelled while they loaded", loaded.start,
                 loaded.end)

    def load(self, old: Assigned | None, start: int, end: int, options: StageOptions, plan: StagePlan | None,
             experts: ExpertPlacement | None, peers: dict[str, Any],
             progress: Callable[[str, float], None]) -> Assigned:
        """On the stage's thread: the new assignment, reusing what `old` holds."""
        if options.dtype == "fp32":
            exact_fp32()
        log.info("loading layers [%d, %d) on %s%s", start, end, self.device,
                 f", wide experts over {len(experts.holders)} holders" if experts is not None else "")
        return assign(self.ckpt, start, end, self.device, options, plan, experts, self.worker_key(), peers, old,
                      progress)

    def close(self) -> None:
        """Close what is held, on the stage's thread, and end that thread."""
        if self.assigned is not None:
            self.executor.submit(self.assigned.close).result()
        self.executor.shutdown(wait=True)
