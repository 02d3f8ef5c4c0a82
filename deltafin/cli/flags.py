"""The command line's option groups, each made from the fields of the typed value it fills and beside the one
function that builds that value from the parsed flags: stage (StageOptions with its SizingOptions), cluster
(ClusterOptions), serving (ServingOptions) and sampling (SamplingParams). A flag's name, type, default, choices and
help are its field's (declared with deltafin.options.opt, once), made into argparse's by `add_fields`. `deltafin`,
`deltafin-worker` and `deltafin-coordinator` share them; below these entry points no argparse Namespace travels,
only the typed values, which check themselves when built (the Python API builds the same values from keywords). The
option types load neither torch nor gRPC, so that `--help` is made at once.

With no sizing flags, a process finds the memory it may use (deltafin/runtime/memory.py) and sizes itself within
it (deltafin/plan/memory/sizing.py): experts in memory if they fit, else streamed with a cache of what is left; a bf16
spine if it fits, else row-int8 with the rest streamed.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from deltafin.coordinator.cluster.cluster_options import ClusterOptions
from deltafin.coordinator.engine.serving_options import ServingOptions
from deltafin.options import GB, Flag, flag, from_values, gb_name
from deltafin.paths import model_path
from deltafin.plan.memory.sizing_options import SizingOptions
from deltafin.runtime.stage_options import StageOptions, stage_options
from deltafin.text.chat import SERVING_MAX_TOKENS
from deltafin.text.sampling_params import SamplingParams


def add_fields(g: Any, cls: type, names: Sequence[str], defaults: Mapping[str, Any] | None = None,
               helps: Mapping[str, str] | None = None) -> None:
    """A flag for each of `cls`'s option fields `names`, in that order, made from the field: its flag (the name's,
    a size in bytes given in GB: `memory_bytes` is `--memory-gb`), its type, its default (or this command's, from
    `defaults`), its choices and its help (or this command's, from `helps`). A switch that is on by default is its
    `--no-` flag; a tuple is a repeatable flag."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for name in names:
        meta: Flag = fields[name].metadata["flag"]
        default = (defaults or {}).get(name, fields[name].default)
        text = (helps or {}).get(name, meta.help() if callable(meta.help) else meta.help)
        kind, gb = _base(hints[name]), gb_name(name)
        shown = default / GB if gb and default is not None else default
        text = text.replace("%(default)s", f"{shown:g}" if isinstance(shown, float) else str(shown))  # written
        # out here: a parser whose defaults are suppressed (the coordinator's shared options) has none to name
        if kind is bool:
            made = g.add_argument(meta.off or flag(name), *meta.aliases, dest=name, help=text,
                                  action="store_false" if default else "store_true")
            made.option_field = name  # what `deltafin.options` field it was made from (the help tests read it)
            continue
        dest = gb or name
        kw: dict[str, Any] = {"dest": dest, "help": text, "metavar": meta.metavar}
        if kind is tuple:
            kw.update(action="append", default=None if default is None else list(default))
        else:
            kw.update(type=float if gb else kind, choices=meta.choices() if callable(meta.choices) else meta.choices,
                      default=shown)
        g.add_argument(meta.name or flag(dest), *meta.aliases, **kw).option_field = name
        for old in meta.hidden:
            g.add_argument(old, **{**kw, "help": argparse.SUPPRESS})


def _base(hint: Any) -> type:
    """The type a field's flag parses: `int | None` is int, `tuple[str, ...]` is tuple."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


def add_stage_options(p: argparse.ArgumentParser, sequences: int | None = None) -> None:
    g = p.add_argument_group("memory and weights", "how the model is held (default: sized to the memory found)")
    add_fields(g, StageOptions, ["memory_bytes"])
    add_fields(g, SizingOptions, ["expert_cache_bytes", "spine"])
    add_fields(g, StageOptions, ["convert", "spine_dir"])
    add_fields(g, SizingOptions, ["sequences", "context", "prefix_cache_bytes", "prefill_chunk", "spill",
                                  "max_resident_layers"], {"sequences": sequences})
    add_fields(g, StageOptions, ["kernels", "expert_mode"])
    r = p.add_argument_group("reads", "how the experts and kept prefixes use the disks")
    add_fields(r, StageOptions, ["expert_dir", "io"])
    add_fields(r, SizingOptions, ["read_threads"])
    add_fields(r, StageOptions, ["cache_policy", "prefetch"])
    r.add_argument("--no-expert-heat", dest="expert_heat", action="store_false",
                   help="do not remember which experts are used: by default a stage that streams experts counts "
                   "each one's use (in the cache directory's heat/, per checkpoint) and at start reads the most used "
                   "into its cache in the background, behind every other read, so the first tokens after a restart "
                   "already hit")
    add_fields(r, StageOptions, ["prefix_dir", "prefix_disk_bytes", "spill_dir"])


def stage_from_args(args: argparse.Namespace) -> StageOptions:
    """The stage options the flags say (no memory budget yet: runtime.stage_options.with_memory_found)."""
    return stage_options(vars(args))


def stage_within_memory(args: argparse.Namespace) -> StageOptions:
    """The flags' stage options within the memory this process finds (or --memory-gb), its kernels selected."""
    from deltafin.devices import resolve_device  # torch: loaded when the command runs
    from deltafin.kernels.linear import select_kernels  # (the same)
    from deltafin.runtime.stage_options import with_memory_found  # (the same)

    options = stage_from_args(args)
    select_kernels(options.kernels)
    return with_memory_found(options, resolve_device(args.device))


def add_device_options(p: argparse.ArgumentParser, device_help: str | None = None) -> None:
    add_fields(p, ClusterOptions, ["device"], helps={"device": device_help} if device_help else None)
    add_fields(p, StageOptions, ["dtype"])


def add_cluster_options(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    """Where the model runs: discovered/named workers, or in-process (--local); and how its stages hold it."""
    p.add_argument("--model", type=model_arg, required=model_required,
                   help=MODEL_HELP + " (the same files as the workers')")
    add_fields(p, ClusterOptions, ["worker", "discover", "discover_timeout", "expect", "interface", "local",
                                   "local_stages", "device", "experts", "hops"],
               helps={"device": "--local: the device the stages compute on (default %(default)s: mps, then cuda, then "
                      "the cpu)"})
    add_fields(p, StageOptions, ["dtype", "wire"])
    add_stage_options(p)
    sec = p.add_argument_group("security",
                               "how this coordinator proves itself to workers (see deploy/README.md, Security)")
    add_fields(sec, ClusterOptions, ["cluster_key", "cluster_key_file", "tls_ca", "tls_cert", "tls_key",
                                     "tls_server_name"])
    rec = p.add_argument_group("fault tolerance")
    add_fields(rec, ClusterOptions, ["worker_timeout", "forward_timeout", "reconnect_timeout", "recovery",
                                     "replay_journal_tokens", "rejoin_interval"])


def cluster_from_args(args: argparse.Namespace) -> ClusterOptions:
    return ClusterOptions.of(vars(args))


def add_speculative_option(p: argparse.ArgumentParser) -> None:
    add_fields(p, ServingOptions, ["speculative", "draft_model"])


MODEL_HELP = "a model: its directory, k3-mini (the bundled one) or a name `deltafin models` lists"


def model_arg(text: str) -> str:
    """--model as argparse takes it: a directory, the bundled model or a model's name (paths.resolve_model); what
    is none of these stays as given, for the command to say what is missing there (load_config: one line)."""
    return str(model_path(text))


def add_serving_options(p: argparse.ArgumentParser) -> None:
    add_fields(p, ServingOptions, ["speculative", "draft_model", "max_active", "queue_depth", "pipeline_depth",
                                   "prefill_batches"])


def serving_from_args(args: argparse.Namespace) -> ServingOptions:
    """The serving options the flags say (a command without the serving group serves with the defaults)."""
    return from_values(ServingOptions, vars(args))


def add_sampling_options(p: argparse.ArgumentParser, temperature: float, max_tokens: int | None) -> None:
    add_speculative_option(p)
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"tokens to generate at most (default {max_tokens or f'up to {SERVING_MAX_TOKENS}'})")
    add_fields(p, SamplingParams, ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                                   "frequency_penalty", "seed"], {"temperature": temperature})
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return from_values(SamplingParams, vars(args))
