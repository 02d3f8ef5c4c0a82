"""What a stage reports of itself when asked: its counters as typed values (the Stats RPC's StageStats message,
field for field). A stage builds them (runtime/stage_stats.py, runtime/wide.py), the worker's servicer adds its
own, the codec carries them, and the coordinator's reports, `/v1/status`, `/metrics` and `Model.stats()` read them;
`as_dict()` is their JSON at the edges. Plain values, no torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from deltafin.plan.memory.stage_plan import StagePlan
from deltafin.weights.expert_stats import DiskStats, ExpertStats

READY = "ready"  # a worker's state once its stage is loaded ("idle", "loading" and "failed" before or instead)


@dataclass(frozen=True)
class HolderStats:
    """A wide stage's calls to one holder of its experts (itself too)."""

    name: str = ""
    calls: int = 0
    experts: int = 0
    pairs: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class WideStats:
    """A worker of a wide plan: what its disks read for its own layers and for other stages', the calls it served,
    and (where it runs a stage) its calls to each holder and its wait on them."""

    share: str = ""  # the experts it computes, e.g. "224/896x92"
    own_expert_bytes: int = 0
    others_expert_bytes: int = 0
    own_lookups: int = 0
    own_hits: int = 0
    others_lookups: int = 0
    others_hits: int = 0
    calls_served: int = 0
    pairs_served: int = 0
    served_s: float = 0.0
    peer_wait_s: float | None = None  # None: an expert holder only (no stage of its own waits)
    holders: tuple[HolderStats, ...] = ()


@dataclass(frozen=True)
class StageStats:
    """One worker's (or local stage's) counters, cumulative since its stage was loaded. A section is None where it
    has nothing to say: `experts` and `compute_s` where its experts are resident (nothing streams), `wide` without
    wide experts, `plan` before an assignment."""

    state: str = READY
    name: str = ""
    layers: tuple[int, int] = (0, 0)  # [start, end); (0, 0): none (an expert holder, or not yet assigned)
    rss_peak_bytes: int = 0
    forwards: int = 0
    tokens: int = 0
    seconds: float = 0.0  # in forwards, by the worker's clock
    experts_s: float = 0.0  # of which producing the routed experts' outputs (reads, compute, holders)
    compute_s: float | None = None  # of which not waiting for reads (where experts stream)
    spine_streamed_bytes: int = 0
    spine_read_s: float = 0.0
    spine_wait_s: float = 0.0
    sessions: int = 0
    session_bytes: int = 0
    prefixes: int = 0  # kept prefixes: entries, bytes, budget, and what happened to them
    prefix_bytes: int = 0
    prefix_budget: int = 0
    prefixes_kept: int = 0
    prefixes_resumed: int = 0
    prefixes_evicted: int = 0
    prefixes_refused: int = 0
    prefixes_restored: int = 0  # read back from the disk
    prefix_disk_files: int = 0
    prefix_disk_bytes: int = 0
    spilled_forwards: int = 0  # forwards whose rows' AttnRes blocks went to the SSD, and their traffic
    spill_bytes_read: int = 0
    spill_bytes_written: int = 0
    spill_s: float = 0.0
    handed_on: int = 0  # forwards whose outputs it handed to the next stage's worker
    hand_offs_failed: int = 0  # ... that it could not (answered to the coordinator instead)
    handed_in: int = 0  # hand-offs it received from the stage before
    experts: ExpertStats | None = None
    disks: tuple[DiskStats, ...] = ()  # where its experts came from (several with --expert-dir)
    wide: WideStats | None = None
    plan: StagePlan | None = None

    @property
    def ready(self) -> bool:
        return self.state == READY

    def as_dict(self) -> dict[str, Any]:
        """JSON: every field, sections as objects (None where absent); the experts' with their hit rate and
        prefetch recall, the plan's with its totals."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["layers"] = list(self.layers)
        out["experts"] = self.experts.as_dict() if self.experts is not None else None
        out["disks"] = [asdict(d) for d in self.disks]
        out["wide"] = asdict(self.wide) if self.wide is not None else None
        out["plan"] = self.plan.as_dict() if self.plan is not None else None
        return out
