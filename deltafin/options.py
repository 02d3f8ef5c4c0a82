"""The command-line options that decide how a stage holds the model, shared by every command that computes
(`deltafin logits|bench`, `deltafin-worker`, `deltafin-coordinator --local`), and their StageOptions.

With no sizing flags, a process finds the memory it may use (deltafin/plan/memory.py) and sizes itself within it
(deltafin/plan/sizing.py): experts in memory if they fit, else streamed with a cache of what is left; a bf16
spine if it fits, else row-int8 with the rest streamed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

from deltafin.paths import cache_dir

log = logging.getLogger(__name__)

GB = 1e9


def add_stage_options(p: argparse.ArgumentParser, sequences: int = 4) -> None:
    _add_memory_options(p.add_argument_group("memory and weights", "how the model is held (default: sized to the "
                                             "memory found)"), sequences)
    _add_reading_options(p.add_argument_group("reads", "how the experts and kept prefixes use the disks"))


def _add_memory_options(g: Any, sequences: int) -> None:
    g.add_argument("--memory-gb", type=float, default=None,
                   help="memory this process may use for the model: weights, caches, buffers, workspace (the GPU's, "
                   "on CUDA). Default: what it finds (RAM, a cgroup limit, the GPU's free memory, Metal's working "
                   "set) less a safety margin")
    g.add_argument("--expert-cache-gb", type=float, default=None,
                   help="stream routed experts from the disk with a cache of this many GB (default: every expert in "
                   "memory if they fit, else streamed with a cache of the memory left)")
    g.add_argument("--spine", default="auto", choices=["auto", "bf16", "int8"],
                   help="non-expert matrices as stored (bf16) or row-int8 (half the memory); default auto: bf16 if "
                   "it fits, else int8; layers that still do not fit stream from the disk")
    g.add_argument("--sequences", type=int, default=sequences,
                   help=f"sequences the memory plan keeps caches for (default {sequences})")
    g.add_argument("--context", type=int, default=4096,
                   help="tokens per sequence the memory plan reserves caches and attention room for (default 4096)")
    g.add_argument("--prefix-cache-gb", type=float, default=None,
                   help="keep sequence state after a request within this many GB, so that a request that starts "
                   "with the same tokens (a chat's next turn) resumes instead of prefilling again; 0: off (default: "
                   "as much as the sequences' caches: --sequences states at --context tokens)")
    g.add_argument("--prefill-chunk", type=int, default=None,
                   help="most tokens one forward carries; longer prompts go in chunks, and each chunk reads the "
                   "experts again (default: the --context tokens in one forward if their workspace fits a tenth of "
                   "the memory, else as many as do, more where a small expert cache can give way; at least 512)")
    g.add_argument("--max-resident-layers", type=int, default=None,
                   help="keep at most this many layers' spine in memory; the rest streams from the disk every token "
                   "(default: as many as fit)")
    g.add_argument("--kernels", default="auto", choices=["auto", "reference", "native", "mlx"],
                   help="auto (default): the native fast paths (C on the CPU, Triton on CUDA), the routed experts on "
                   "MLX on Apple silicon; reference: plain torch everywhere; native; mlx: the routed experts on MLX")


def _add_reading_options(g: Any) -> None:
    g.add_argument("--expert-dir", action="append", default=[], metavar="DIR",
                   help="another copy (or part) of the checkpoint on another disk (repeatable): the routed experts "
                   "are read from every disk that holds them, in proportion to each disk's measured speed (e.g. a "
                   "Mac's internal SSD and a Thunderbolt SSD); the rest of the model is read from --model")
    g.add_argument("--io", default="direct", choices=["direct", "buffered"],
                   help="read experts with O_DIRECT/F_NOCACHE (default) or through the page cache")
    g.add_argument("--threads", type=int, default=8, help="parallel readers of experts and streamed layers (default 8)")
    g.add_argument("--policy", default="lfu", choices=["lru", "lfu", "pinned"],
                   help="expert cache policy (default lfu: the best of the three on measured decode traces)")
    g.add_argument("--no-prefetch", action="store_true", help="read experts only when a layer asks for them")
    g.add_argument("--prefix-dir", default=None,
                   help="also keep prefixes on this disk folder, so that a request sharing one resumes after a "
                   "restart too (default: the cache directory's prefixes/)")
    g.add_argument("--prefix-disk-gb", type=float, default=32.0,
                   help="what kept prefixes may take on the disk, least recently used out first (default 32; 0: "
                   "memory only)")


def check_stage_args(args: argparse.Namespace) -> None:
    from deltafin.errors import DeltafinError

    for name in ("sequences", "context", "prefill_chunk", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise DeltafinError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("memory_gb", "expert_cache_gb", "prefix_cache_gb", "max_resident_layers", "prefix_disk_gb"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise DeltafinError(f"--{name.replace('_', '-')} must not be negative")


def explicit_options(args: argparse.Namespace) -> dict[str, Any]:
    """StageOptions fields the command line sets, before any memory is looked at (no budget). Selects the
    process's kernels (--kernels) as a side effect: they are per process, not per stage."""
    from deltafin.kernels.linear import select_kernels

    check_stage_args(args)
    select_kernels(args.kernels)
    gb = lambda v: None if v is None else int(v * GB)
    return {"spine": args.spine, "expert_cache_bytes": gb(args.expert_cache_gb),
            "prefix_bytes": gb(args.prefix_cache_gb), "io": args.io,
            "read_threads": args.threads, "cache_policy": args.policy, "prefetch": not args.no_prefetch,
            "sequences": args.sequences, "context": args.context, "max_forward_tokens": args.prefill_chunk,
            "max_resident_layers": args.max_resident_layers, "expert_dirs": tuple(args.expert_dir),
            "prefix_dir": (args.prefix_dir or str(cache_dir("prefixes"))) if args.prefix_disk_gb else None,
            "prefix_disk_bytes": int(args.prefix_disk_gb * GB)}


def stage_options(args: argparse.Namespace, device: Any, dtype: Any = None):  # -> StageOptions
    """StageOptions from the command line, with the memory budget: --memory-gb, or what this process finds it
    may use on `device` (a torch.device)."""
    from deltafin.plan.memory import find_memory
    from deltafin.runtime.stage import StageOptions

    found = find_memory(device.type, device.index)
    device_budget, host_budget = found.budget
    if args.memory_gb is not None:
        device_budget = int(args.memory_gb * GB)
        log.info("memory budget %.2f GB (--memory-gb)", device_budget / GB)
    else:
        log.info("memory budget %.2f GB: %s, less a safety margin", device_budget / GB, found.source)
    options = StageOptions(**explicit_options(args), memory_bytes=device_budget, host_memory_bytes=host_budget)
    return options if dtype is None else dataclasses.replace(options, dtype=dtype)
