"""The command line's option groups, each beside the one function that turns its parsed flags into its typed
value: stage (StageOptions with its SizingOptions), cluster (ClusterOptions), serving (ServingOptions) and
sampling (SamplingParams). `deltafin`, `deltafin-worker` and `deltafin-coordinator` share them; below these
entry points no argparse Namespace travels, only the typed values, which check themselves when built (the
Python API builds the same values from keywords).

With no sizing flags, a process finds the memory it may use (deltafin/plan/memory.py) and sizes itself within
it (deltafin/plan/sizing.py): experts in memory if they fit, else streamed with a cache of what is left; a bf16
spine if it fits, else row-int8 with the rest streamed.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from deltafin.formats import auto_spines, converted_spines, spine_choices, spine_formats
from deltafin.options import (
    CACHE_POLICIES,
    DEVICES,
    DTYPES,
    EXPERT_MODES,
    IO_MODES,
    KERNELS,
    PREFILL_BATCHES,
    WIRES,
    from_values,
)
from deltafin.paths import model_path
from deltafin.text.chat import SERVING_MAX_TOKENS
from deltafin.text.drafting import MODES

if TYPE_CHECKING:  # these load torch: they are imported when a command builds them, not for --help
    from deltafin.coordinator.cluster.connect import ClusterOptions
    from deltafin.coordinator.engine.engine import ServingOptions
    from deltafin.runtime.stage_options import StageOptions
    from deltafin.text.sampling import SamplingParams


def add_stage_options(p: argparse.ArgumentParser, sequences: int | None = None) -> None:
    _add_memory_options(p.add_argument_group("memory and weights", "how the model is held (default: sized to the "
                                             "memory found)"), sequences)
    _add_reading_options(p.add_argument_group("reads", "how the experts and kept prefixes use the disks"))


def _add_memory_options(g: Any, sequences: int | None) -> None:
    g.add_argument("--memory-gb", type=float, default=None,
                   help="memory this process may use for the model: weights, caches, buffers, workspace (the GPU's, "
                   "on CUDA). Default: what it finds (RAM, a cgroup limit, the GPU's free memory, Metal's working "
                   "set) less a safety margin")
    g.add_argument("--expert-cache-gb", type=float, default=None,
                   help="stream routed experts from the disk with a cache of this many GB (default: every expert in "
                   "memory if they fit, else streamed with a cache of the memory left)")
    g.add_argument("--spine", default="auto", choices=spine_choices(), help=spine_help())
    g.add_argument("--no-convert", dest="convert", action="store_false",
                   help="refuse to start when the plan needs an int8/q4 spine that is not converted on the disk yet "
                   "(default: convert it first, once, into the cache directory, as `deltafin convert` does)")
    g.add_argument("--spine-dir", default=None, metavar="DIR",
                   help="where converted spines are (`deltafin convert --out DIR`; default: the cache directory's "
                   "spines/)")
    g.add_argument("--sequences", type=int, default=sequences,
                   help="sequences the memory plan keeps caches for (default "
                   + (f"{sequences})" if sequences is not None else "1 on one worker, serving one user, so that its "
                      "expert cache keeps more; 4 on each stage of a cluster; serve: its --max-active)"))
    add_context_option(g)
    g.add_argument("--prefix-cache-gb", type=float, default=None,
                   help="keep sequence state after a request within this many GB, so that a request that starts "
                   "with the same tokens (a chat's next turn) resumes instead of prefilling again; 0: off (default: "
                   "as much as the sequences' caches: --sequences states at --max-context tokens)")
    g.add_argument("--prefill-chunk", type=int, default=None,
                   help="most tokens one forward carries; longer prompts go in chunks, and each chunk reads the "
                   "experts again (default: the --max-context tokens, 4,096 where it is not given, in one forward "
                   "if their workspace fits a tenth of the memory, else as many as do, more where a small expert "
                   "cache can give way; on one worker the longest that leaves the expert cache 21.5%% of the "
                   "memory; at least 512)")
    g.add_argument("--max-resident-layers", type=int, default=None,
                   help="keep at most this many layers' spine in memory; the rest streams from the disk every token "
                   "(default: as many as fit)")
    g.add_argument("--kernels", default="auto", choices=KERNELS,
                   help="auto (default): the native fast paths (C on the CPU, Triton on CUDA), the routed experts on "
                   "MLX on Apple silicon; reference: plain torch everywhere; native; mlx: the routed experts on MLX")


def spine_help() -> str:
    """`--spine`'s help, from the registry of formats (deltafin/formats)."""
    formats = ", ".join(f"{f.name} ({f.summary})" for f in spine_formats())
    return (f"non-expert matrices {formats}; quality in docs/k3-mini.md; {' and '.join(reversed(converted_spines()))} "
            "are converted once and kept on the disk (see --no-convert); default auto: "
            + ", else ".join(f"{f} if it fits" for f in auto_spines()) + "; layers that still do not fit stream from "
            "the disk")


CONTEXT_HELP = ("tokens a request may have, prompt and reply, which the memory plan reserves caches and attention "
                "room for; a longer request is refused before its prefill (default: the model's own maximum, or the "
                "longest the memory holds beside the plan's expert cache, whichever is less: `plan` and `inspect` "
                "say which, and what a longer one would cost; at K3's width each 1,024 tokens take 57 MB per "
                "sequence)")


def add_context_option(g: Any, help_text: str = CONTEXT_HELP) -> None:
    """--max-context (the plan's `context`); --context, its name before, still works."""
    g.add_argument("--max-context", dest="context", type=int, default=None, metavar="N", help=help_text)
    g.add_argument("--context", dest="context", type=int, default=None, help=argparse.SUPPRESS)


def _add_reading_options(g: Any) -> None:
    g.add_argument("--expert-dir", action="append", default=[], metavar="DIR",
                   help="another copy (or part) of the checkpoint on another disk (repeatable): the routed experts "
                   "are read from every disk that holds them, in proportion to each disk's measured speed (e.g. a "
                   "Mac's internal SSD and a Thunderbolt SSD); the rest of the model is read from --model")
    g.add_argument("--io", default="direct", choices=IO_MODES,
                   help="read experts with O_DIRECT/F_NOCACHE (default) or through the page cache")
    g.add_argument("--read-threads", "--threads", dest="read_threads", type=int, default=8,
                   help="parallel readers of experts and streamed layers (default 8)")
    g.add_argument("--cache-policy", "--policy", dest="cache_policy", default="lfu", choices=CACHE_POLICIES,
                   help="expert cache policy (default lfu: the best of the three on measured decode traces)")
    g.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help="read experts only when a layer asks for them")
    g.add_argument("--no-expert-heat", dest="expert_heat", action="store_false",
                   help="do not remember which experts are used: by default a stage that streams experts counts "
                   "each one's use (in the cache directory's heat/, per checkpoint) and at start reads the most used "
                   "into its cache in the background, behind every other read, so the first tokens after a restart "
                   "already hit")
    g.add_argument("--prefix-dir", default=None,
                   help="also keep prefixes on this disk folder, so that a request sharing one resumes after a "
                   "restart too (default: the cache directory's prefixes/)")
    g.add_argument("--prefix-disk-gb", type=float, default=None,
                   help="what kept prefixes may take on the disk, least recently used out first (default: room for "
                   "64 of the model's kept states at --context tokens, at most 32 GB: K3's 32 GB, k3-mini's 0.36 GB; "
                   "0: memory only)")


def stage_from_args(args: argparse.Namespace) -> StageOptions:
    """The stage options the flags say (no memory budget yet: runtime.stage_options.with_memory_found)."""
    from deltafin.runtime.stage_options import stage_options  # torch: loaded when a command runs

    return stage_options(vars(args))


def add_device_options(p: argparse.ArgumentParser, device_help: str | None = None) -> None:
    p.add_argument("--device", default="auto", choices=DEVICES, help=device_help)
    p.add_argument("--dtype", default="fp32", choices=DTYPES, help="activation dtype (default fp32)")


def add_cluster_options(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    """Where the model runs: discovered/named workers, or in-process (--local); and how its stages hold it."""
    p.add_argument("--model", type=model_arg, required=model_required,
                   help=MODEL_HELP + " (the same files as the workers')")
    p.add_argument("--worker", action="append", default=[], metavar="HOST:PORT",
                   help="a worker to use (repeatable; port 1-65535, an IPv6 host in brackets: [::1]:7070); "
                   "discovered workers are added unless --no-discover")
    p.add_argument("--no-discover", dest="discover", action="store_false", help="use only the --worker addresses")
    p.add_argument("--discover-timeout", type=float, default=3.0, help="seconds to browse for workers")
    p.add_argument("--expect", type=int, default=None, help="stop browsing once this many workers answered")
    p.add_argument("--interface", action="append", default=None,
                   help="browse only on this interface address")
    p.add_argument("--local", action="store_true", help="single-machine mode: run the stages in this process")
    p.add_argument("--local-stages", type=int, default=1, help="--local: in-process stages (default 1)")
    add_device_options(p, "--local: device")
    p.add_argument("--experts", default="auto", choices=EXPERT_MODES,
                   help="wide: every worker reads and computes its share of every layer's routed experts, so every "
                   "disk works on every token; local: each stage reads its own layers' experts; auto (default): "
                   "wide with more than one worker")
    p.add_argument("--wire", default="fp32", choices=WIRES,
                   help="what crosses the links between the machines: fp32 (default: exact), or bf16 (half the "
                   "bytes of the stage hops' states and the wide experts' rows and sums; lossy: its cost in "
                   "docs/cluster.md, measured like the spine formats)")
    add_stage_options(p)
    sec = p.add_argument_group("security",
                               "how this coordinator proves itself to workers (see deploy/README.md, Security)")
    sec.add_argument("--cluster-key", default=None,
                     help="the workers' shared secret (or $DELTAFIN_CLUSTER_KEY, or --cluster-key-file)")
    sec.add_argument("--cluster-key-file", default=None, help="read the cluster key from this file")
    sec.add_argument("--tls-ca", default=None,
                     help="connect with TLS, trusting workers' certificates signed by this CA (PEM)")
    sec.add_argument("--tls-cert", default=None, help="mutual TLS: this coordinator's certificate (PEM)")
    sec.add_argument("--tls-key", default=None, help="mutual TLS: its private key (PEM)")
    sec.add_argument("--tls-server-name", default=None,
                     help="the name the workers' certificates carry, when it is not the address dialled")
    _add_recovery_options(p)


def _add_recovery_options(p: argparse.ArgumentParser) -> None:
    rec = p.add_argument_group("fault tolerance")
    rec.add_argument("--worker-timeout", type=float, default=10.0,
                     help="a worker that shows no sign of life for this many seconds during a forward is lost: "
                     "no answer to the liveness probes (on a connection of their own) and no part of the forward's "
                     "states sent or received, so a slow link that still moves them is not a dead worker (default "
                     "10)")
    rec.add_argument("--forward-timeout", type=float, default=600.0,
                     help="deadline of one stage's forward of up to 512 tokens, longer ones in proportion (default "
                     "600: one prompt chunk may stream every expert of the stage)")
    rec.add_argument("--no-recovery", dest="recovery", action="store_false",
                     help="fail requests when a worker is lost instead of re-planning and replaying")
    rec.add_argument("--replay-journal-tokens", type=int, default=1 << 22,
                     help="tokens of live sequences kept for replay after a worker loss, 4 bytes each (default "
                     "4194304 = 16 MB); sequences beyond it fail instead of recovering")
    rec.add_argument("--rejoin-interval", type=float, default=5.0,
                     help="seconds between looks for returning or new workers while idle (0: never; default 5)")


def cluster_from_args(args: argparse.Namespace) -> ClusterOptions:
    from deltafin.coordinator.cluster.connect import ClusterOptions  # torch and grpc: loaded when a command runs

    return ClusterOptions.of(vars(args))


def add_speculative_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", default="none", choices=MODES,
                   help="ngram: draft tokens from the prompt and the output so far and verify several in one "
                   "forward (the same output; fewer passes over the weights when drafts land; the plan gives "
                   "every sequence room for a verification's KDA trail, 0.21 GB at K3's width); none: one token "
                   "per forward (default)")


MODEL_HELP = "a model: its directory, k3-mini (the bundled one) or a name `deltafin models` lists"


def model_arg(text: str) -> str:
    """--model as argparse takes it: a directory, the bundled model or a model's name (paths.resolve_model); what
    is none of these stays as given, for the command to say what is missing there (load_config: one line)."""
    return str(model_path(text))


def add_serving_options(p: argparse.ArgumentParser) -> None:
    add_speculative_option(p)
    p.add_argument("--max-active", type=int, default=4,
                   help="requests generating at once; their steps are batched (default 4)")
    p.add_argument("--queue-depth", type=int, default=16,
                   help="requests waiting for a slot; more are refused with 429 (default 16)")
    p.add_argument("--pipeline-depth", type=int, default=0,
                   help="batches in flight through the stages at once (default 0: one per stage that computes "
                   "beside the others, so every stage works; CPU workers on one host share its cores and count "
                   "once; 1: one batch of all active requests)")
    p.add_argument("--prefill-batches", default="ride", choices=PREFILL_BATCHES,
                   help="ride: running streams' decode steps go in the same batch as the next prompt chunk "
                   "(default; at K3's sizes a chunk reads nearly every expert, so the steps cost no reads); "
                   "separate: prompt chunks and decode steps take turns in batches of their own")


def serving_from_args(args: argparse.Namespace) -> ServingOptions:
    """The serving options the flags say (a command without the serving group serves with the defaults)."""
    from deltafin.coordinator.engine.engine import ServingOptions  # torch and grpc: loaded when a command runs

    return from_values(ServingOptions, vars(args))


def add_sampling_options(p: argparse.ArgumentParser, temperature: float, max_tokens: int | None) -> None:
    add_speculative_option(p)
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"tokens to generate at most (default {max_tokens or f'up to {SERVING_MAX_TOKENS}'})")
    p.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 is greedy (default {temperature:g})")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens up to this mass")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the best one's p")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (same seed, same output)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    from deltafin.text.sampling import SamplingParams  # torch: loaded when a command runs

    return from_values(SamplingParams, vars(args))
