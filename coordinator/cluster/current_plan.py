"""The plan in force over the cluster: its backend and plan, every worker address seen so far, and how to
reach the workers that might join a new plan (named, discovered on Bonjour, the current ones).

`CurrentPlan.adopt` is the one step that puts a new plan in force; ResilientCluster's re-plans (recovery.py)
and Membership's rejoins (membership.py) both go through it.
"""

from __future__ import annotations

import contextlib
import logging

from deltafin.checkpoint.config import ModelConfig
from deltafin.coordinator.cluster.backend import ClusterBackend
from deltafin.coordinator.cluster.workers import ClusterSpec, Worker, discover_addresses, probe_workers
from deltafin.plan.cluster.cluster_plan import ClusterPlan

log = logging.getLogger(__name__)


class CurrentPlan:
    """The backend and plan serving now, and the addresses of every worker the cluster has known."""

    def __init__(self, spec: ClusterSpec, cfg: ModelConfig, backend: ClusterBackend, plan: ClusterPlan) -> None:
        self.spec, self.cfg, self.backend, self.plan = spec, cfg, backend, plan
        self.known = list(dict.fromkeys([*spec.addresses, *(w.address for w in backend.workers)]))

    async def adopt(self, backend: ClusterBackend, plan: ClusterPlan) -> None:
        """Put a new plan in force: its backend serves from now on, its workers are known, the old one closes."""
        old, self.backend, self.plan = self.backend, backend, plan
        self.known = list(dict.fromkeys([*self.known, *(w.address for w in backend.workers)]))
        with contextlib.suppress(Exception):
            await old.close()

    async def candidates(self) -> list[Worker]:
        """Every known or discovered worker that answers."""
        addresses = list(dict.fromkeys([*self.known, *await self.discovered()]))
        return await probe_workers(self.spec, addresses, quiet=True, timeout=self.probe_timeout())

    def probe_timeout(self) -> float:
        """A worker that does not answer Info this fast is not a candidate (a frozen one never answers)."""
        t = self.spec.timeouts
        return min(t.control, max(t.lost_after / 2, 1.0))

    async def discovered(self) -> list[str]:
        if not self.spec.discover:
            return []
        try:
            return await discover_addresses(self.spec, timeout=min(self.spec.discover_timeout, 1.5))
        except Exception as e:  # Bonjour trouble must not stop a recovery over the named workers
            log.warning("looking for workers on Bonjour failed (going on with the named ones): %s", e)
            return []
