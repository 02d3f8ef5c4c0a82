"""A stage's plan as a value (pure): every part of its memory and what it reads per token, as the planner made it
(sizing.py), the wire carries it (transport/codec.py) and the stage loads it; and the budget it is made against."""

from __future__ import annotations

from dataclasses import asdict, dataclass

GB = 1e9


@dataclass(frozen=True)
class StagePlan:
    """Every part of a stage's memory, and what it reads per token. Bytes unless named otherwise."""

    start: int
    end: int
    device: str
    spine: str  # bf16 | int8 | q4, as chosen
    resident_layers: tuple[int, ...]
    streamed_layers: tuple[int, ...]
    layers: int  # resident layers as placed
    top: int
    stream_buffers: int  # host: two read buffers of the largest streamed layer
    stream_copies: int  # the two streamed layers' tensors placed from those buffers
    experts_resident: bool
    expert_cache: int  # cache slots (experts resident: every expert)
    expert_staging: int  # host: the store's read slots
    expert_landing: int  # device: slots that landed reads are copied into (GPUs)
    expert_calls: int  # wide experts: the buffers of expert calls made and served (rows out, outputs back)
    sessions: int
    prefixes: int  # sequence state kept after its request, for the next request that shares its prefix
    workspace: int
    overhead: int  # host: the runtime
    forward_tokens: int  # the most tokens a forward carries beside the expert cache (a decode step, a short prompt)
    spine_bytes_per_token: int  # spine read per token (streamed layers)
    expert_bytes_per_token: int  # expected expert reads per token (uniform router: hit rate = cache share)
    discrete: bool = False  # host parts live apart from the device's memory
    expert_layers: int = 0  # MoE layers whose experts the store serves (wide: others' layers too)
    expert_share: float = 1.0  # the fraction of those layers' experts this worker computes (wide)
    sequences: int = 0  # sequences the sessions are planned for (their bytes as fixed, where session_bytes is)
    spine_why: str = ""  # why this spine format (auto: what the others would have cost; else as asked)
    converted: bool = True  # an int8/q4 spine is read from its converted copy (else quantized as it loads, its
    # streamed layers read as stored: SizingInput.converted)
    context: int = 0  # tokens a sequence may hold: what the sessions and the attention room are planned for
    wide: bool = False  # a wide plan's: its store serves `expert_share` of `expert_layers` MoE layers' experts
    prompt_tokens: int = 0  # the most a prompt's forward carries: longer than `forward_tokens` where the expert cache
    # is lent to it for that forward (its workspace takes the cache's memory; decode takes it back): `_lend_cache`
    spill_tokens: int = 0  # the most a spilled forward carries, its rows' AttnRes blocks on the SSD (spill_cost.py),
    # where longer than `prompt_tokens` (a stage of every layer whose prompts borrow the cache): `_spill`
    expert_read_share: float = 1.0  # of a token's k routed experts, the share its expert mode reads (predict.py)

    @property
    def holder_only(self) -> bool:
        """A wide worker with no layers of its own: it only serves expert calls."""
        return self.end == self.start

    PARTS = ("layers", "top", "stream_buffers", "stream_copies", "expert_cache", "expert_staging", "expert_landing",
             "expert_calls", "sessions", "prefixes", "workspace", "overhead")
    HOST_PARTS = ("stream_buffers", "expert_staging", "overhead")

    @property
    def total(self) -> int:
        return sum(getattr(self, p) for p in self.PARTS)

    @property
    def host(self) -> int:
        """Bytes in host memory apart from the device's (discrete GPUs; 0 elsewhere)."""
        return sum(getattr(self, p) for p in self.HOST_PARTS) if self.discrete else 0

    @property
    def device_total(self) -> int:
        """Bytes against the device budget (everything, on a CPU or a Mac)."""
        return self.total - self.host

    @property
    def longest_forward(self) -> int:
        """Tokens one forward may carry: a prompt's, with the cache lent to it and, past that, spilled."""
        return max(self.forward_tokens, self.prompt_tokens, self.spill_tokens)

    @property
    def streaming(self) -> bool:
        return not self.experts_resident

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(total=self.total, host=self.host, device_total=self.device_total)
        return d

    def parts(self) -> str:
        """Each part's memory in GB (what the plan trades); sessions and kept prefixes are budgets they grow into."""
        return ", ".join(f"{p.replace('_', ' ')} {'up to ' * (p in ('sessions', 'prefixes'))}{getattr(self, p)/GB:.2f}"
                         for p in self.PARTS if getattr(self, p))

    def describe(self) -> str:
        why = f"; spine {self.spine}: {self.spine_why}" if self.spine_why else ""
        return f"{self.total / GB:.2f} GB at most: {self.parts()}{why}"


@dataclass(frozen=True)
class Budget:
    """Memory a stage may use: `device` bytes (the only pool on a CPU or a Mac), and on a discrete GPU
    `host` bytes of RAM for the staging buffers and the runtime (None: not checked)."""

    device: int
    host: int | None = None

    def fits(self, s: StagePlan) -> bool:
        return s.device_total <= self.device and (self.host is None or s.host <= self.host)
