"""A cluster's plan as a value (pure): what the planner knows of each worker (`WorkerCapacity`), each stage it gave one
(`PlannedStage`) and the whole (`ClusterPlan`), with the table `plan` prints. The planner (planner.py) makes them;
first-token times (first_token.py) and the coordinator read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltafin.plan.cluster.compute import ComputeSpeed
from deltafin.plan.cluster.expert_placement import ExpertRanges
from deltafin.plan.cluster.links import Links
from deltafin.plan.memory.sizing import Placement, SizingInput
from deltafin.plan.memory.spine_copies import SpineDisk
from deltafin.plan.memory.stage_plan import Budget, StagePlan

GB = 1e9
VERIFY_SHOWN = (0, 1, 2, 4, 8)  # drafts per step the plan's table prices


@dataclass(frozen=True)
class Seconds:
    """A predicted time (plan/timing/predict.py): what the disks take, what the links take, what the compute takes (0:
    not known), and the total (less than their sum where they overlap)."""

    disk: float
    link: float
    total: float
    compute: float = 0.0

    def describe(self) -> str:
        compute = f", compute {_time(self.compute)}" if self.compute else ""
        return f"{_time(self.total)} (disks {_time(self.disk)}, links {_time(self.link)}{compute})"

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
    expert_layers: tuple[tuple[int, int], ...] | None = None  # ranges whose experts it can read (None: `layers`)
    expert_gbps: float = 0.0  # its expert disks together (0: disk_gbps)
    disks: int = 1  # disks it reads experts from
    damaged: tuple[str, ...] = ()  # damaged shards on its disk ("FILE: layers A-B"), for the plan's errors
    spine: str = "auto"  # the format it was started with (--spine): the plan honours it or refuses
    spine_disk: SpineDisk | None = None  # the converted spines on its disk (None: not known, taken as writable)
    compute: ComputeSpeed | None = None  # measured (plan/cluster/compute.py; None: not known, its compute left out)

    @property
    def key(self) -> str:
        """What identifies the worker: its id, else its address, else its name."""
        return self.worker_id or self.address or self.name

    def holds(self, start: int, end: int) -> bool:
        return any(a <= start and end <= b for a, b in self.layers)

    def holds_experts(self, layer: int) -> bool:
        return any(a <= layer < b for a, b in (self.layers if self.expert_layers is None else self.expert_layers))

    @property
    def expert_speed(self) -> float:
        return self.expert_gbps or self.disk_gbps

    @property
    def budget(self) -> Budget:
        return Budget(self.memory_bytes, self.host_memory_bytes)


@dataclass(frozen=True)
class PlannedStage:
    worker: str
    address: str
    start: int
    end: int
    plan: StagePlan
    seconds_per_token: float
    worker_id: str = ""
    memory_bytes: int = 0  # the worker's budget the stage was sized against
    host_memory_bytes: int | None = None
    disk_gbps: float = 0.0  # its model disk (the spine streams from it)
    expert_gbps: float = 0.0  # its expert disks together (0: disk_gbps)
    compute: ComputeSpeed | None = None  # the worker's, measured (None: not known)

    @property
    def key(self) -> str:
        return self.worker_id or self.address or self.worker

    @property
    def spine_bytes(self) -> int:
        """Resident spine (layers and top) as placed."""
        return self.plan.layers + self.plan.top

    @property
    def streamed_bytes(self) -> int:
        """Spine bytes read per token (layers that do not stay resident)."""
        return self.plan.spine_bytes_per_token

    @property
    def cache_bytes(self) -> int:
        return 0 if self.plan.experts_resident else self.plan.expert_cache

    @property
    def expert_bytes_per_token(self) -> int:
        return self.plan.expert_bytes_per_token


@dataclass(frozen=True)
class ClusterPlan:
    stages: tuple[PlannedStage, ...]
    holders: tuple[PlannedStage, ...] = ()  # wide experts: workers with no layers, serving their share (start == end)
    experts: ExpertRanges | None = None  # wide experts: who computes which routed experts
    links: Links = field(default_factory=Links)  # what the links were measured (or assumed) to be
    token: Seconds | None = None  # a decoded token, predicted (plan/timing/predict.py)
    first_token: tuple[tuple[int, Seconds], ...] = ()  # (prompt tokens, its time to the first token), predicted
    verify: tuple[float, ...] = ()  # a decode step's seconds verifying 0, 1, ... drafts, predicted (drafting's cost)
    mode_why: str = ""  # why wide or local experts (as asked, or what the links and disks make each cost)
    kept_prefixes: str = ""  # what a kept prefix costs, where states are kept (sizing.kept_prefixes_text)
    context: int = 0  # tokens a request may have (prompt and reply): what the sessions were planned for
    context_why: str = ""  # as asked, the model's own maximum, or what memory holds (and what more would cost)

    @property
    def wide(self) -> bool:
        return self.experts is not None

    @property
    def workers(self) -> tuple[PlannedStage, ...]:
        return self.stages + self.holders

    @property
    def seconds_per_token(self) -> float:
        if self.token is not None:
            return self.token.total
        return sum(s.seconds_per_token for s in self.stages)

    def summary(self) -> str:
        """The plan in one line (`table` holds the whole of it)."""
        stages = ", ".join(f"{s.worker} layers {s.start}-{s.end - 1}" for s in self.stages)
        holders = f" + {len(self.holders)} expert holder(s)" if self.holders else ""
        return (f"plan: {stages}{holders}; experts {'wide' if self.wide else 'local'}; a token "
                f"{_time(self.seconds_per_token)} predicted (-v: the whole plan)")

    def table(self) -> str:
        text = self._wide_table() if self.wide else self._table()
        text += self._parts() + self._times()
        if self.context:
            text += f"\ncontext: {self.context:,} tokens a request (prompt and reply): {self.context_why}"
        if self.kept_prefixes:
            text += "\n" + self.kept_prefixes
        return text

    def _times(self) -> str:
        """The links, the experts' mode and why, and the predictions: a token, a prompt's first token."""
        lines = ["links (" + ("measured" if self.links.measured else f"assumed: {self.links.assumed.describe()}")
                 + "):", *self.links.describe()]
        speeds = [(s.worker, s.compute) for s in self.workers]
        lines += ["compute (measured by each worker):" if all(c for _, c in speeds) else
                  "compute (measured by each worker; left out of the predictions where not known):"]
        lines += [f"  {name}: {c.describe() if c else 'not known'}" for name, c in speeds]
        if self.mode_why:
            lines.append(f"experts {'wide' if self.wide else 'local'}: {self.mode_why}")
        if self.token is not None:
            lines.append(f"a token (predicted from bytes, disk speeds, links and compute): {self.token.describe()}")
        if self.first_token:
            lines.append(self.first_token_line())
        if self.verify:
            lines.append("a decode step verifying k drafts (one forward, the union of their experts; drafting weighs "
                         "its expected tokens against it): " + ", ".join(
                             f"k={k} {self.verify[k]:.3g} s" for k in VERIFY_SHOWN if k < len(self.verify)))
        return "\n" + "\n".join(lines)

    def first_token_line(self) -> str:
        """The predicted first token of each of the prompt lengths planned for, in the forwards the plan cuts a
        prompt into (borrowing the expert cache where its stages lend it), and which of them the context refuses."""
        step = min(s.plan.longest_forward for s in self.stages)
        lent = ", the expert cache lent to them" if any(
            s.plan.prompt_tokens > s.plan.forward_tokens for s in self.stages) else ""
        if any(s.plan.spill_tokens for s in self.stages):
            lent += f" and past {min(s.plan.prompt_tokens for s in self.stages):,} tokens their blocks on the disk"
        over = [n for n, _ in self.first_token if self.context and n > self.context]
        text = (f"time to first token (prompts in forwards of up to {step:,} tokens{lent}): "
                + ", ".join(f"{n // 1024}K {t.describe()}" for n, t in self.first_token if n not in over))
        if over:
            text += (f"; {', '.join(f'{n // 1024}K' for n in over)} over the context ({self.context:,} tokens): "
                     "--max-context plans for more")
        return text

    def _parts(self) -> str:
        """Why the spine format, and what each part of each worker's memory takes (GB): the plan's trade."""
        first = self.stages[0].plan if self.stages else None
        lines = [f"\nspine {first.spine}: {first.spine_why}"] if first is not None and first.spine_why else []
        lines += [f"  {s.worker}: {describe_forwards(s.plan)}, {s.plan.sequences} sequence(s); {s.plan.parts()}"
                  for s in self.workers]
        return "\n".join(["", *lines]) if lines else ""

    def _wide_table(self) -> str:
        assert self.experts is not None
        head = (f"{'worker':<16} {'address':<21} {'dev':<5} {'layers':>7} {'spine':>11} {'resident':>9} "
                f"{'experts':>13} {'cache GB':>8} {'total/budget GB':>16} {'exp GB/tok':>10} {'spine GB/tok':>12} "
                f"{'disk s/tok':>10}")
        rows = [head]
        for s in self.workers:
            z = s.plan
            layers = "-" if z.holder_only else f"{s.start}-{s.end - 1}"
            spine = "-" if z.holder_only else f"{z.spine} {len(z.resident_layers)}/{z.end - z.start}"
            share = self.experts.describe(self.experts.holders.index(s.key))
            rows.append(f"{s.worker[:16]:<16} {s.address[:21]:<21} {z.device:<5} {layers:>7} {spine:>11} "
                        f"{s.spine_bytes / GB:>9.2f} {share:>13} {z.expert_cache / GB:>8.2f} "
                        f"{f'{z.device_total / GB:.1f}/{s.memory_bytes / GB:.1f}':>16} "
                        f"{z.expert_bytes_per_token / GB:>10.3f} {z.spine_bytes_per_token / GB:>12.3f} "
                        f"{s.seconds_per_token:>10.3f}")
        experts = sum(s.plan.expert_bytes_per_token for s in self.workers) / GB
        spine = sum(s.plan.spine_bytes_per_token for s in self.workers) / GB
        rows.append(f"{'total (wide)':<16} {'':<21} {'':<5} {'':>7} {'':>11} "
                    f"{sum(s.spine_bytes for s in self.workers) / GB:>9.2f} {'':>13} {'':>8} {'':>16} "
                    f"{experts:>10.3f} {spine:>12.3f} {self.seconds_per_token:>10.3f}")
        rows.append("wide experts: every worker reads and computes its share of every MoE layer's routed experts for "
                    "every stage (experts: of a layer's, x layers); cache GB: its expert cache")
        rows.append("exp/spine GB/tok: what its disks read per token; disk s/tok: that at their speed; total: s/token "
                    "with every disk reading at once (per MoE layer the slowest holder's expected reads, then the "
                    "calls' round trip and rows over the links), and the stage hops")
        return "\n".join(rows)

    def _table(self) -> str:
        head = (f"{'worker':<16} {'address':<21} {'dev':<5} {'layers':>7} {'spine':>11} {'resident':>9} "
                f"{'experts':>9} {'sessions':>8} {'total/budget GB':>16} {'GB/token':>9} {'s/token':>8}")
        rows = [head]
        for s in self.stages:
            z = s.plan
            spine = f"{z.spine} {len(z.resident_layers)}/{z.end - z.start}"
            experts = "resident" if z.experts_resident else f"{z.expert_cache / GB:.2f} c"
            per_token = (z.expert_bytes_per_token + z.spine_bytes_per_token) / GB
            rows.append(f"{s.worker[:16]:<16} {s.address[:21]:<21} {z.device:<5} {f'{s.start}-{s.end - 1}':>7} "
                        f"{spine:>11} {s.spine_bytes / GB:>9.2f} {experts:>9} {z.sessions / GB:>8.2f} "
                        f"{f'{z.device_total / GB:.1f}/{s.memory_bytes / GB:.1f}':>16} {per_token:>9.3f} "
                        f"{s.seconds_per_token:>8.3f}")
        total = sum((s.plan.expert_bytes_per_token + s.plan.spine_bytes_per_token) for s in self.stages) / GB
        rows.append(f"{'total':<16} {'':<21} {'':<5} {'':>7} {'':>11} "
                    f"{sum(s.spine_bytes for s in self.stages) / GB:>9.2f} {'':>9} {'':>8} {'':>16} {total:>9.3f} "
                    f"{self.seconds_per_token:>8.3f}")
        rows.append("spine: format, layers resident of the stage's; resident: spine + embedding/head GB; experts: "
                    "resident, or the cache (c) in GB; GB/token: expert + spine bytes read per token")
        return "\n".join(rows)


def stage_placement(w: WorkerCapacity, act_bytes: int, opts: SizingInput | None = None) -> Placement:
    """Where a worker's stage holds its tensors, as its own stage will: a Mac runs its routed experts on MLX (the
    package requires MLX on macOS arm64), read in place into MLX slots, so its plan has no landing slots; not in an
    expert mode that reads a low-bit copy (`opts.expert_copy`: its experts run one by one, runtime/stage_build.py
    expert_backend_for)."""
    mlx = w.device == "mps" and (opts is None or opts.expert_copy is None)
    return Placement(w.device, act_bytes, "mlx" if mlx else "torch")


def _time(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds < 10 else _minutes(seconds)


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def describe_forwards(z: StagePlan) -> str:
    """A stage's forwards: beside its expert cache, and a prompt's with the cache lent to it."""
    if z.prompt_tokens > z.forward_tokens:
        spilled = f", up to {z.spill_tokens:,} with its blocks on the disk" if z.spill_tokens else ""
        return (f"{z.forward_tokens:,}-token forwards beside the expert cache, a prompt's up to {z.prompt_tokens:,} "
                f"with it lent{spilled}")
    return f"{z.forward_tokens:,}-token forwards"
