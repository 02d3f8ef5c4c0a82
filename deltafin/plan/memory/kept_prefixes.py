"""Where a stage keeps prefix states, and what one costs: the grid of kept states inside long messages, and the
line `plan` and `inspect` print about it (the coordinator's prefix index keeps states there:
coordinator/engine/prefix_index.py)."""

from __future__ import annotations

from deltafin.checkpoint.config import LayerKind, ModelConfig
from deltafin.plan.memory.sizing_options import BASE_CONTEXT
from deltafin.plan.memory.stage_parts import kda_state_bytes, mla_row_bytes, sequence_bytes
from deltafin.plan.memory.stage_plan import GB

GRID_MIN = 1024  # fewest tokens between two states kept inside one long message
GRID_ROUND = 256


def prefix_grid(cfg: ModelConfig, n_kda: int, n_mla: int, act_bytes: int, capacity: int, context: int) -> int:
    """Tokens between the states a stage keeps inside a long message (or a prompt with no messages), counted
    from the prompt's start. A kept state costs its KDA layers' states wherever it is taken, plus its latents,
    and saves the prefill of the tokens before it: the grid is as dense as lets a prompt of the planned
    `context` keep its grid in a quarter of the `capacity` for kept prefixes (memory, or the disk where the
    stage keeps them there), never denser than every GRID_MIN tokens; `context` when not even one fits (only
    the messages' ends and the prompt's are kept then)."""
    def grid_bytes(step: int) -> int:
        return sum(sequence_bytes(cfg, n_kda, n_mla, at, act_bytes) for at in range(step, context, step))

    step = GRID_MIN
    while step < context and grid_bytes(step) > capacity // 4:
        step += GRID_ROUND
    return step


KEPT_ON_DISK = 64  # kept states a stage's disk has room for by default (--prefix-disk-gb) ...
PREFIX_DISK_BYTES = 32 * 10**9  # ... but never more than this


def default_prefix_disk_bytes(cfg: ModelConfig, context: int | None, act_bytes: int) -> int:
    """What a stage's kept prefixes may take on its disk unless --prefix-disk-gb says: room for KEPT_ON_DISK states
    of the whole model (a stage's own are no larger) at `context` tokens (at most BASE_CONTEXT: kept states are
    conversations' prefixes, while a plan's context may reach a model's million tokens), at most PREFIX_DISK_BYTES.
    At K3's width 64 states of 4,096 tokens are 44 GB, so 32 GB; k3-mini's are 5.7 MB each, so 0.36 GB. The stage
    and `doctor` both ask here."""
    n_kda = sum(k is LayerKind.KDA for k in cfg.layer_kinds)
    tokens = min(context or BASE_CONTEXT, BASE_CONTEXT)
    state = sequence_bytes(cfg, n_kda, len(cfg.layer_kinds) - n_kda, tokens, act_bytes)
    return min(PREFIX_DISK_BYTES, KEPT_ON_DISK * state)


def kept_prefixes_text(cfg: ModelConfig, stages: list[tuple[int, int, int]], act_bytes: int, context: int,
                       disk: int | None = None) -> str:
    """What a kept prefix costs and where states are kept, as `plan` and `inspect` print it: the state of a
    boundary at this model's width (its KDA layers' states, and its MLA layers' latents a token), and the grid
    (the densest of the stages': `stages` are (start, end, memory for kept prefixes)). `disk`: a stage's disk
    budget for them (default: `default_prefix_disk_bytes`)."""
    kinds = cfg.layer_kinds
    n_kda = sum(k is LayerKind.KDA for k in kinds)
    n_mla = len(kinds) - n_kda
    disk = default_prefix_disk_bytes(cfg, context, act_bytes) if disk is None else disk
    grids = [prefix_grid(cfg, sum(k is LayerKind.KDA for k in kinds[a:b]), sum(k is LayerKind.MLA for k in kinds[a:b]),
                         act_bytes, disk or memory, context) for a, b, memory in stages]
    grid = max(grids, default=context)
    where = f"every {grid:,} tokens inside long messages, " if grid < context else ""
    memory = sum(m for _, _, m in stages)
    return (f"kept prefixes: a state is {n_kda * kda_state_bytes(cfg) / GB:.3f} GB ({n_kda} KDA layers) + "
            f"{n_mla * mla_row_bytes(cfg, act_bytes) / 1e3:.1f} KB a token ({n_mla} MLA layers' latents); "
            f"{memory / GB:.2f} GB of memory for them" + (f" and {_gb(disk)} of disk a stage" if disk else "")
            + f"; kept at message ends, cache breakpoints, {where}prompts' and requests' ends")


def _gb(n: int) -> str:
    """A disk budget in GB, with the digits a small one needs (32 GB; 0.012 GB)."""
    return f"{n / GB:.0f} GB" if n >= 10 * GB else f"{n / GB:.3g} GB"
