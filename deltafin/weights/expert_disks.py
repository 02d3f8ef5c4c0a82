"""The expert store's disks: the checkpoint and any copies (or parts) of it on other disks, each with shard files
and reader threads of its own, and which disk reads each expert. The experts of the layers the store serves are
divided among the disks that hold them in proportion to their speed (plan/cluster/expert_placement.py, the code that
divides a layer among workers); an expert of any other layer is read from the first disk that holds it. Ids from the
layer's expert count up are a converted copy's (weights/expert_copy.py: an expert mode reads expert e there as id
E + e), read by the first disk's readers: the copy is on the machine's own disk; one the copy does not hold (a wide
worker converts its share) is read as stored."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from deltafin.checkpoint.shards import Checkpoint
from deltafin.plan.cluster.expert_placement import ExpertRanges
from deltafin.weights.expert_copy import ExpertCopy
from deltafin.weights.expert_slots import Key
from deltafin.weights.expert_stats import DiskStats
from deltafin.weights.reader import WARM, ExpertReader, ReadPlan, ShardFiles, plan_read

WARM_RANK = 1 << 30  # beyond any layer: warming reads queue behind every demand read and guess


@dataclass
class Disk:
    """One copy (or part) of the checkpoint on one disk, with readers of its own."""

    ckpt: Checkpoint
    gbps: float
    files: ShardFiles
    reader: ExpertReader

    def holds(self, layer: int) -> bool:
        return layer in self.ckpt.layers_available()


class ExpertDisks:
    """`ckpt`'s disk, then one per copy, read in proportion to `disk_gbps` (one figure per disk; None: all alike),
    each with `threads` readers doing `io` reads; `low`, the converted copy an expert mode reads."""

    def __init__(self, ckpt: Checkpoint, copies: Sequence[Checkpoint], disk_gbps: Sequence[float] | None, io: str,
                 threads: int, low: ExpertCopy | None = None):
        speeds = list(disk_gbps) if disk_gbps is not None else [1.0] * (1 + len(copies))
        if len(speeds) != 1 + len(copies):
            raise ValueError(f"{len(speeds)} disk speeds for {1 + len(copies)} disks")
        self.disks: list[Disk] = []
        for c, gbps in zip((ckpt, *copies), speeds, strict=True):
            files = ShardFiles(io)
            self.disks.append(Disk(c, gbps, files, ExpertReader(files, threads=threads)))
        self.num_experts, self.low = ckpt.config.num_experts, low
        self.layers: set[int] = set()
        self.ranges: ExpertRanges | None = None
        self._plans: dict[Key, tuple[Disk, ReadPlan]] = {}

    def place(self, layers: set[int]) -> None:
        """Divide the experts of `layers` (the layers served) among the disks."""
        self.layers = layers
        self._plans.clear()
        self.ranges = None
        if len(self.disks) > 1 and self.layers:
            self.ranges = ExpertRanges.build(
                [str(i) for i in range(len(self.disks))], sorted(self.layers), self.num_experts,
                lambda i, layer: self.disks[i].gbps if self.disks[i].holds(layer) else 0.0)

    def plan(self, key: Key) -> tuple[Disk, ReadPlan]:
        """The disk that reads an expert, and its read there."""
        found = self._plans.get(key)
        if found is None and key[1] >= self.num_experts:
            layer, e = key[0], key[1] - self.num_experts
            if self.low is None:
                raise ValueError(f"expert {key[1]} of layer {layer}: a low-bit copy's id, and no copy was opened")
            # one this worker did not convert (a wide prompt's expert beyond its share): read as stored
            found = (self.disks[0], self.low.plan(layer, e)) if self.low.holds(layer, e) else self.plan((layer, e))
            self._plans[key] = found
        elif found is None:
            if self.ranges is not None and key[0] in self.layers:
                disk = self.disks[self.ranges.owner(*key)]
            else:
                disk = next((d for d in self.disks if d.holds(key[0])), self.disks[0])
            found = self._plans[key] = (disk, plan_read(disk.ckpt.expert(*key)))
        return found

    def nbytes(self, key: Key) -> int:
        """The bytes an expert's read brings (a converted copy's fewer)."""
        return self.plan(key)[1].nbytes

    def submit(self, key: Key, priority: int, pool: Any, deliver: Callable[[int, ReadPlan], object],
               abort: Callable[[], bool] | None) -> Future:
        """Queue an expert's read on its disk's readers (earlier layers first, then by `priority`; a warming read
        after every other read of any layer)."""
        disk, plan = self.plan(key)
        rank = (WARM_RANK, key[0]) if priority == WARM else (key[0], priority)
        return disk.reader.submit(rank, plan, pool, deliver, abort)

    def read_totals(self) -> tuple[int, int, float]:
        """(reads, bytes read, seconds reading) summed over the disks."""
        r = [d.files.stats for d in self.disks]
        return sum(x.reads for x in r), sum(x.bytes_read for x in r), sum(x.read_seconds for x in r)

    def stats(self) -> list[DiskStats]:
        """Each disk's directory, planned speed and reads."""
        return [DiskStats(str(d.ckpt.model_dir), d.gbps, d.files.stats.bytes_read, d.files.stats.reads)
                for d in self.disks]

    def close(self) -> None:
        for d in self.disks:
            d.reader.close()
            d.files.close()
