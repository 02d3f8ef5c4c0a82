"""Layer partition across workers (pure): contiguous ranges, sized by memory and disk bandwidth, only from
layers each worker holds, with an explanation table.

Cost of a stage per token = (expert bytes missed + spine bytes streamed) / the worker's disk bandwidth.
A worker's memory holds its resident spine, the embedding/head if it is first/last, the expert store's
working buffers, and an expert cache with the rest (hit rate = cache / the stage's expert bytes, what a
uniform router gives). For one sequence the stages run one after another, so the plan minimizes the sum;
ties (e.g. equal disks) are broken toward equal memory use, so ranges come out memory-weighted.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from deltafin.config import ModelConfig
from deltafin.errors import DeltafinError

GB = 1e9


class PlanError(DeltafinError):
    pass


@dataclass(frozen=True)
class WorkerCapacity:
    name: str
    memory_bytes: int
    disk_gbps: float
    layers: tuple[tuple[int, int], ...]  # [start, end) ranges on its disk
    has_top: bool  # embedding/head present
    address: str = ""

    def holds(self, start: int, end: int) -> bool:
        return any(a <= start and end <= b for a, b in self.layers)


@dataclass(frozen=True)
class StagePlan:
    worker: str
    address: str
    start: int
    end: int
    spine_bytes: int  # resident
    streamed_bytes: int  # spine bytes read per token (layers that do not fit)
    cache_bytes: int
    expert_bytes_per_token: float
    seconds_per_token: float


@dataclass(frozen=True)
class Plan:
    stages: tuple[StagePlan, ...]

    @property
    def seconds_per_token(self) -> float:
        return sum(s.seconds_per_token for s in self.stages)

    def table(self) -> str:
        rows = [f"{'worker':<18} {'address':<21} {'layers':>9} {'spine GB':>9} {'streamed':>9} {'cache GB':>9} "
                f"{'GB/token':>9} {'s/token':>8}"]
        for s in self.stages:
            rows.append(f"{s.worker:<18} {s.address:<21} {f'{s.start}-{s.end - 1}':>9} {s.spine_bytes / GB:>9.2f} "
                        f"{s.streamed_bytes / GB:>9.2f} {s.cache_bytes / GB:>9.2f} "
                        f"{(s.expert_bytes_per_token + s.streamed_bytes) / GB:>9.3f} {s.seconds_per_token:>8.3f}")
        rows.append(f"{'total':<18} {'':<21} {'':>9} {sum(s.spine_bytes for s in self.stages) / GB:>9.2f} "
                    f"{sum(s.streamed_bytes for s in self.stages) / GB:>9.2f} "
                    f"{sum(s.cache_bytes for s in self.stages) / GB:>9.2f} "
                    f"{sum(s.expert_bytes_per_token + s.streamed_bytes for s in self.stages) / GB:>9.3f} "
                    f"{self.seconds_per_token:>8.3f}")
        return "\n".join(rows)


@dataclass(frozen=True)
class _Sizes:
    """Per-layer byte counts with prefix sums (so a range costs O(1))."""

    cfg: ModelConfig
    spine: str
    working_bytes: int

    @cached_property
    def resident(self) -> list[int]:
        return _prefix([self.cfg.resident_spine_bytes(i, self.spine) for i in range(self.cfg.num_layers)])

    @cached_property
    def stored(self) -> list[int]:
        return _prefix([sum(s.nbytes for s in self.cfg.layer_tensor_specs(i)) for i in range(self.cfg.num_layers)])

    @cached_property
    def max_stored(self) -> list[int]:
        return [sum(s.nbytes for s in self.cfg.layer_tensor_specs(i)) for i in range(self.cfg.num_layers)]

    @cached_property
    def moe(self) -> list[int]:
        return _prefix([1 if self.cfg.is_moe(i) else 0 for i in range(self.cfg.num_layers)])

    @cached_property
    def top(self) -> tuple[int, int]:
        """(embedding bytes, head + final norms bytes) as held resident."""
        specs = self.cfg.top_tensor_specs()
        embed = sum(s.nbytes for s in specs if "embed_tokens" in s.name)
        head = sum(s.nbytes for s in specs if "embed_tokens" not in s.name)
        return embed, head // 2 if self.spine == "int8" else head

    def stage(self, w: WorkerCapacity, a: int, b: int, first: bool, last: bool) -> StagePlan | None:
        cfg = self.cfg
        fixed = self.working_bytes + (self.top[0] if first else 0) + (self.top[1] if last else 0)
        spine = self.resident[b] - self.resident[a]
        room = w.memory_bytes - fixed
        if spine <= room:
            resident, streamed, buffers = spine, 0, 0
        else:
            buffers = 2 * max(self.max_stored[a:b])
            resident = max(0, room - buffers)
            if room < buffers:
                return None  # not even the working set fits
            ratio = (self.stored[b] - self.stored[a]) / max(1, spine)  # stored bytes per resident byte
            streamed = int((spine - resident) * ratio)
        cache = max(0, room - resident - buffers)
        n_moe = self.moe[b] - self.moe[a]
        experts = n_moe * cfg.num_experts * cfg.bytes_per_expert
        hit = min(1.0, cache / experts) if experts else 0.0
        expert_bytes = n_moe * cfg.experts_per_token * cfg.bytes_per_expert * (1 - hit)
        seconds = (expert_bytes + streamed) / (max(w.disk_gbps, 1e-3) * GB)
        return StagePlan(w.name, w.address, a, b, resident, streamed, cache, expert_bytes, seconds)


def _prefix(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def working_bytes(cfg: ModelConfig, read_threads: int = 8, overhead: int = 10**9) -> int:
    """What a stage needs besides weights: the expert store's buffers and a fixed runtime overhead."""
    return (3 * cfg.experts_per_token + read_threads) * cfg.bytes_per_expert + overhead


def plan_layers(cfg: ModelConfig, workers: list[WorkerCapacity], spine: str = "bf16",
                working: int | None = None) -> Plan:
    """Contiguous ranges covering every layer once, in the given worker order (workers that cannot
    usefully take layers are left out). Raises PlanError with the reason when no plan exists."""
    if not workers:
        raise PlanError("no workers to plan over")
    sizes = _Sizes(cfg, spine, working_bytes(cfg) if working is None else working)
    n = cfg.num_layers
    inf = float("inf")
    # best[i][b]: (cost, stages) covering layers [0, b) with the first i workers
    best: list[list[tuple[float, tuple[StagePlan, ...]] | None]] = [[None] * (n + 1) for _ in range(len(workers) + 1)]
    best[0][0] = (0.0, ())
    for i, w in enumerate(workers):
        for b in range(n + 1):
            prev = best[i][b]  # skip this worker
            cand = prev
            for a in range(b):
                before = best[i][a]
                if before is None or not w.holds(a, b):
                    continue
                first, last = a == 0, b == n
                if (first or last) and not w.has_top:
                    continue
                stage = sizes.stage(w, a, b, first, last)
                if stage is None:
                    continue
                # tie-break: sum of spine^2 / memory is least when spines are proportional to memory
                balance = (stage.spine_bytes + stage.streamed_bytes) ** 2 / max(1, w.memory_bytes) / GB
                cost = before[0] + stage.seconds_per_token + 1e-3 * balance
                if cand is None or cost < cand[0]:
                    cand = (cost, (*before[1], stage))
            best[i + 1][b] = cand
    done = best[len(workers)][n]
    if done is None or done[0] == inf:
        raise PlanError(_why_not(cfg, workers, sizes))
    return Plan(done[1])


def _why_not(cfg: ModelConfig, workers: list[WorkerCapacity], sizes: _Sizes) -> str:
    have = set()
    for w in workers:
        for a, b in w.layers:
            have.update(range(a, b))
    missing = [i for i in range(cfg.num_layers) if i not in have]
    if missing:
        return f"no worker holds layers {_ranges(missing)}: copy them to a worker's disk or add a worker that has them"
    if not any(w.has_top for w in workers):
        return "no worker holds the embedding/head shard: the first and last stages need it"
    need = sizes.working_bytes + max(sizes.max_stored) * 2 + sum(sizes.top)
    biggest = max(w.memory_bytes for w in workers)
    return (f"the cluster cannot hold the model's working set: a stage needs at least {need / GB:.2f} GB "
            f"(expert buffers, embedding/head, two streamed layers) and the largest worker offers "
            f"{biggest / GB:.2f} GB; add memory or workers")


def _ranges(ids: list[int]) -> str:
    out: list[list[int]] = []
    for i in ids:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)
