"""Layer partition across workers (pure): contiguous ranges, sized by memory and disk bandwidth, only from
layers each worker holds, with an explanation table.

Every candidate stage is sized by sizing.choose on that worker's device and budget (the same function the
worker's stage runs on the assignment), so a plan that fits here fits there. Cost of a stage per token =
(expected expert bytes missed + spine bytes streamed) / the worker's disk bandwidth. For one sequence the
stages run one after another, so the plan minimizes the sum; ties (e.g. equal disks) are broken toward
memory-proportional ranges.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

from deltafin.config import ModelConfig
from deltafin.errors import PlanError, SizingError
from deltafin.sizing import Budget, Placement, SizingOptions, StageSizing, choose

GB = 1e9




@dataclass(frozen=True)
class WorkerCapacity:
    name: str  # for display
    memory_bytes: int  # the stage's budget: device memory on a GPU, RAM on a CPU or a Mac
    disk_gbps: float
    layers: tuple[tuple[int, int], ...]  # [start, end) ranges on its disk
    has_top: bool  # embedding/head present
    address: str = ""
    device: str = "cpu"  # device type: cpu | cuda | mps
    host_memory_bytes: int | None = None  # RAM beside a discrete GPU
    worker_id: str = ""  # unique per worker process (names need not be)

    @property
    def key(self) -> str:
        """What identifies the worker: its id, else its address, else its name."""
        return self.worker_id or self.address or self.name

    def holds(self, start: int, end: int) -> bool:
        return any(a <= start and end <= b for a, b in self.layers)

    @property
    def budget(self) -> Budget:
        return Budget(self.memory_bytes, self.host_memory_bytes)


@dataclass(frozen=True)
class StagePlan:
    worker: str
    address: str
    start: int
    end: int
    sizing: StageSizing
    seconds_per_token: float
    worker_id: str = ""
    memory_bytes: int = 0  # the worker's budget the stage was sized against
    host_memory_bytes: int | None = None

    @property
    def key(self) -> str:
        return self.worker_id or self.address or self.worker

    @property
    def spine_bytes(self) -> int:
        """Resident spine (layers and top) as placed."""
        return self.sizing.layers + self.sizing.top

    @property
    def streamed_bytes(self) -> int:
        """Spine bytes read per token (layers that do not stay resident)."""
        return self.sizing.spine_bytes_per_token

    @property
    def cache_bytes(self) -> int:
        return 0 if self.sizing.experts_resident else self.sizing.expert_cache

    @property
    def expert_bytes_per_token(self) -> int:
        return self.sizing.expert_bytes_per_token


@dataclass(frozen=True)
class Plan:
    stages: tuple[StagePlan, ...]

    @property
    def seconds_per_token(self) -> float:
        return sum(s.seconds_per_token for s in self.stages)

    def table(self) -> str:
        head = (f"{'worker':<16} {'address':<21} {'dev':<5} {'layers':>7} {'spine':>11} {'resident':>9} "
                f"{'experts':>9} {'sessions':>8} {'total/budget GB':>16} {'GB/token':>9} {'s/token':>8}")
        rows = [head]
        for s in self.stages:
            z = s.sizing
            spine = f"{z.spine} {len(z.resident_layers)}/{z.end - z.start}"
            experts = "resident" if z.experts_resident else f"{z.expert_cache / GB:.2f} c"
            per_token = (z.expert_bytes_per_token + z.spine_bytes_per_token) / GB
            rows.append(f"{s.worker[:16]:<16} {s.address[:21]:<21} {z.device:<5} {f'{s.start}-{s.end - 1}':>7} "
                        f"{spine:>11} {s.spine_bytes / GB:>9.2f} {experts:>9} {z.sessions / GB:>8.2f} "
                        f"{f'{z.device_total / GB:.1f}/{s.memory_bytes / GB:.1f}':>16} {per_token:>9.3f} "
                        f"{s.seconds_per_token:>8.3f}")
        total = sum((s.sizing.expert_bytes_per_token + s.sizing.spine_bytes_per_token) for s in self.stages) / GB
        rows.append(f"{'total':<16} {'':<21} {'':<5} {'':>7} {'':>11} "
                    f"{sum(s.spine_bytes for s in self.stages) / GB:>9.2f} {'':>9} {'':>8} {'':>16} {total:>9.3f} "
                    f"{self.seconds_per_token:>8.3f}")
        rows.append("spine: format, layers resident of the stage's; resident: spine + embedding/head GB; experts: "
                    "resident, or the cache (c) in GB; GB/token: expert + spine bytes read per token")
        return "\n".join(rows)


def plan_layers(cfg: ModelConfig, workers: list[WorkerCapacity], options: SizingOptions | None = None,
                act_bytes: int = 4) -> Plan:
    """Contiguous ranges covering every layer once, in the given worker order (workers that cannot
    usefully take layers are left out). Raises PlanError with the reason when no plan exists.

    The spine format is one for the whole cluster: with `spine="auto"`, bf16 if the cluster holds all of it
    resident, else row-int8 (and whatever int8 does not fit streams)."""
    if not workers:
        raise PlanError("no workers to plan over")
    opts = options or SizingOptions()
    if opts.spine == "auto":
        plan = _plan(cfg, workers, replace(opts, spine="bf16"), act_bytes, resident_only=True)
        if plan is not None:
            return plan
        opts = replace(opts, spine="int8")
    plan = _plan(cfg, workers, opts, act_bytes, resident_only=False)
    if plan is None:
        raise PlanError(_why_not(cfg, workers, opts, act_bytes))
    return plan


def _plan(cfg: ModelConfig, workers: list[WorkerCapacity], opts: SizingOptions, act_bytes: int,
          resident_only: bool) -> Plan | None:
    """The cheapest plan in one spine format (with `resident_only`, stages that stream spine are left out)."""
    n = cfg.num_layers

    @cache
    def size(device: str, budget: Budget, a: int, b: int) -> StageSizing | None:
        try:
            return choose(cfg, a, b, Placement(device, act_bytes), budget, opts)
        except SizingError:
            return None

    # best[i][b]: (cost, stages) covering layers [0, b) with the first i workers
    best: list[list[tuple[float, tuple[StagePlan, ...]] | None]] = [[None] * (n + 1) for _ in range(len(workers) + 1)]
    best[0][0] = (0.0, ())
    for i, w in enumerate(workers):
        for b in range(n + 1):
            cand = best[i][b]  # skip this worker
            for a in range(b - 1, -1, -1):  # longer ranges need at least as much memory: stop at the first miss
                before = best[i][a]
                if not w.holds(a, b):
                    break
                if before is None or ((a == 0 or b == n) and not w.has_top):
                    continue
                sizing = size(w.device, w.budget, a, b)
                if sizing is None or (resident_only and sizing.streamed_layers):
                    break
                seconds = (sizing.expert_bytes_per_token + sizing.spine_bytes_per_token) / (max(w.disk_gbps, 1e-3)
                                                                                           * GB)
                stage = StagePlan(w.name, w.address, a, b, sizing, seconds, w.worker_id, w.memory_bytes,
                                  w.host_memory_bytes)
                # tie-break: sum of spine^2 / memory is least when spines are proportional to memory
                weight = sizing.layers + sizing.top + sizing.spine_bytes_per_token
                cost = before[0] + seconds + 1e-3 * weight ** 2 / max(1, w.memory_bytes) / GB
                if cand is None or cost < cand[0]:
                    cand = (cost, (*before[1], stage))
            best[i + 1][b] = cand
    done = best[len(workers)][n]
    return None if done is None else Plan(done[1])


def _why_not(cfg: ModelConfig, workers: list[WorkerCapacity], opts: SizingOptions, act_bytes: int) -> str:
    have = set()
    for w in workers:
        for a, b in w.layers:
            have.update(range(a, b))
    missing = [i for i in range(cfg.num_layers) if i not in have]
    if missing:
        return f"no worker holds layers {_ranges(missing)}: copy them to a worker's disk or add a worker that has them"
    if not any(w.has_top for w in workers):
        return "no worker holds the embedding/head shard: the first and last stages need it"
    biggest = max(workers, key=lambda w: w.memory_bytes)
    try:  # the smallest useful stage on the largest worker: one layer with the embedding
        choose(cfg, 0, 1, Placement(biggest.device, act_bytes), biggest.budget, opts)
    except SizingError as e:
        return f"the cluster cannot hold the model's working set: on {biggest.name}, {e}"
    return (f"the workers' memory ({', '.join(f'{w.name} {w.memory_bytes / GB:.1f} GB' for w in workers)}) cannot "
            f"hold all {cfg.num_layers} layers with their working sets: add memory or workers")


def _ranges(ids: list[int]) -> str:
    out: list[list[int]] = []
    for i in ids:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)
