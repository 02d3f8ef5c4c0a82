"""`deltafin inspect`: what a checkpoint holds, what one token costs to read, and what is wrong with it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.manifest import DownloadRecord, read_record
from deltafin.checkpoint.shards import Checkpoint, scan_checkpoint
from deltafin.errors import ModelFormatError, SizingError
from deltafin.formats import spine_formats, stored_spine
from deltafin.options import more_than_zero
from deltafin.plan.memory.context import context_why, cost_per_1k, grown
from deltafin.plan.memory.kept_prefixes import kept_prefixes_text
from deltafin.plan.memory.layer_table import layer_table, unfit_spines
from deltafin.plan.memory.least import check_fits
from deltafin.plan.memory.sizing import Placement, SizingInput, choose
from deltafin.plan.memory.sizing_options import SEQUENCES, SizingOptions, base_context, one_worker
from deltafin.plan.memory.stage_plan import Budget, StagePlan
from deltafin.weights.reader import layer_spans


def inspect_model(model_dir: str | Path, memory_bytes: int | None = None, device: str = "cpu",
                  options: SizingOptions | None = None) -> dict[str, Any]:
    """A JSON-able report of the checkpoint at `model_dir` (config errors raise; tensor problems are listed).
    With `memory_bytes`, also the memory plan of one stage of every layer within it on `device`."""
    more_than_zero(memory_gb=memory_bytes)
    cfg = load_config(model_dir)
    ckpt = scan_checkpoint(model_dir, cfg)
    table = layer_table(cfg, Placement(device), layer_spans(ckpt))
    layers = []
    spine_total: dict[str, int] = {}
    formats = [f.name for f in spine_formats()]
    for i in range(cfg.num_layers):
        spine = cfg.spine_bytes(i)
        for k, v in spine.items():
            spine_total[k] = spine_total.get(k, 0) + v
        layers.append({"layer": i, "kind": cfg.layer_kinds[i].value, "ffn": "moe" if cfg.is_moe(i) else "dense",
                       "attn_res_blocks": cfg.blocks_entering(i), "spine_bytes": spine,
                       "resident_bytes": {f: table.resident(f)[i + 1] - table.resident(f)[i]
                                          for f in formats},
                       "streamed_bytes": {f: table.streamed(f).stored[i] for f in formats}})
    top = cfg.top_spine_bytes()
    n_moe = len(cfg.moe_layers)
    contiguous, scattered, missing = _contiguity(ckpt)
    download = read_record(model_dir)
    return {
        "model_dir": str(Path(model_dir).resolve()),
        "model_type": cfg.model_type,
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "kda_layers": list(cfg.kda_layers),
        "mla_layers": list(cfg.mla_layers),
        "moe_layers": list(cfg.moe_layers),
        "layers": layers,
        "spine_bytes": {"layers": spine_total, "top": top,
                        "total": sum(spine_total.values()) + sum(top.values())},
        "experts": {
            "format": cfg.expert_format.value,
            "per_layer": cfg.num_experts,
            "active": cfg.experts_per_token,
            "bytes_per_expert": cfg.bytes_per_expert,
            "total_bytes": n_moe * cfg.num_experts * cfg.bytes_per_expert,
            "bytes_per_token": cfg.expert_bytes_per_token(),
            "contiguous": contiguous,
            "non_contiguous": scattered,
            "unreadable": missing,
            "all_contiguous": scattered == 0 and missing == 0,
        },
        "layers_available": list(ckpt.layers_available()),
        "unused_tensors": len(set(ckpt.tensors) - _text_tensors(cfg)),  # e.g. the vision tower: skipped
        "unusable_spines": unfit_spines(cfg),  # formats that hold none of its matrices: auto and convert skip them
        "plan": None if memory_bytes is None else memory_plan(cfg, memory_bytes, device, options, layer_spans(ckpt)),
        "download": None if download is None else {"summary": download.describe(), "layers": list(download.layers),
                                                    "experts": download.experts and list(download.experts),
                                                    "share": download.share, "left_out": list(download.left_out),
                                                    "complete": download.complete},
        "problems": [p.message for p in ckpt.problems if not _left_out(p.message, download)],
    }


def _left_out(message: str, download: DownloadRecord | None) -> bool:
    """A problem a partial download has on purpose: a shard of another worker's layers is not there."""
    return download is not None and any(message.startswith(f"shard {s} is listed") for s in download.left_out)


def _text_tensors(cfg: Any) -> set[str]:
    names = {s.name for s in cfg.top_tensor_specs()}
    for i in range(cfg.num_layers):
        names.update(s.name for s in cfg.layer_tensor_specs(i))
        names.update(a for s in cfg.layer_tensor_specs(i) for a in s.aliases)
        if cfg.is_moe(i):
            names.update(s.name for e in range(cfg.num_experts) for s in cfg.expert_tensor_specs(i, e))
    return names


def memory_plan(cfg: Any, memory_bytes: int, device: str, options: SizingOptions | None = None,
                spans: tuple[int, ...] | None = None) -> dict:
    """The memory plan of one stage of every layer within `memory_bytes` on `device` (pure; `spans`: the
    checkpoint's layers' read buffers), with what its one-worker defaults trade (`trade`), or {"error": why}."""
    opts = SizingInput.of(options or SizingOptions(), spans=spans)
    place = Placement(device, experts="mlx" if device == "mps" else "torch")  # a Mac runs its experts on MLX
    try:
        z = grown(cfg, check_fits(cfg, 0, cfg.num_layers, place, Budget(memory_bytes), opts), place,
                  Budget(memory_bytes), opts)
    except SizingError as e:
        return {"error": str(e)}
    plan = z.as_dict()
    kept = kept_prefixes_text(cfg, [(0, cfg.num_layers, plan["prefixes"])], place.act_bytes, z.context)
    why = context_why(cfg, opts, z.context, cost_per_1k(cfg, z, place, opts))
    return {**plan, "context_why": why, "trade": _trade(cfg, place, Budget(memory_bytes), opts, plan),
            "kept_prefixes": kept}


def _trade(cfg: Any, place: Placement, budget: Budget, opts: SizingInput, plan: dict) -> list[dict]:
    """What the one-worker defaults trade (sizing.py: one sequence of a long context, and a prompt's forward
    borrowing the expert cache): the plan with each of them given back, as the flag that does it would make it."""
    if plan["experts_resident"] or not one_worker(cfg, 0, cfg.num_layers, opts):
        return []
    changes, tokens = [], base_context(cfg)  # a cluster stage's context, and a forward that long
    if opts.context is None and plan["context"] > tokens:
        changes.append((f"--max-context {tokens}", replace(opts, context=tokens)))
    if opts.prefill_chunk is None and plan["prompt_tokens"] > plan["forward_tokens"]:
        changes.append((f"--prefill-chunk {tokens}", replace(opts, prefill_chunk=tokens)))
    if opts.sequences is None and opts.session_bytes is None:
        changes.append((f"--sequences {SEQUENCES}", replace(opts, sequences=SEQUENCES)))
    out = []
    for flag, changed in changes:
        try:
            z = choose(cfg, 0, cfg.num_layers, place, budget, changed)
        except SizingError as e:
            out.append({"flags": flag, "error": str(e)})
            continue
        out.append({"flags": flag, "spine": z.spine, "resident_layers": len(z.resident_layers),
                    "expert_cache": z.expert_cache, "forward_tokens": z.forward_tokens,
                    "prompt_tokens": z.longest_forward, "context": z.context, "sessions": z.sessions,
                    "prefixes": z.prefixes, "workspace": z.workspace, "spine_bytes_per_token": z.spine_bytes_per_token})
    return out


def _contiguity(ckpt: Checkpoint) -> tuple[int, int, int]:
    contiguous = scattered = missing = 0
    cfg = ckpt.config
    for layer in cfg.moe_layers:
        for e in range(cfg.num_experts):
            try:
                loc = ckpt.expert(layer, e)
            except ModelFormatError:
                missing += 1
                continue
            if loc.contiguous:
                contiguous += 1
            else:
                scattered += 1
    return contiguous, scattered, missing


def plan_lines(plan: dict, num_layers: int) -> list[str]:
    """A memory plan (`memory_plan`) as `inspect` prints it: the choice, its parts, its reads, its trade."""
    if "error" in plan:
        return [f"memory plan: {plan['error']}"]
    experts = "resident" if plan["experts_resident"] else "streamed"
    return [f"memory plan on {plan['device']}: {plan['spine']} spine, {len(plan['resident_layers'])} of "
            f"{num_layers} layers resident, experts {experts}; {_gb(plan['device_total'])} in all",
            f"  spine {plan['spine']}: {plan['spine_why']}",
            "  " + ", ".join(f"{k.replace('_', ' ')} {_gb(plan[k])}" for k in StagePlan.PARTS if plan[k]),
            f"  sessions for {plan['sequences']} sequence(s) of up to {plan['context']:,} tokens; read per token: "
            f"experts {_gb(plan['expert_bytes_per_token'])}, spine {_gb(plan['spine_bytes_per_token'])}; "
            + _forwards(plan),
            f"  context: {plan['context']:,} tokens a request: {plan['context_why']}",
            f"  {plan['kept_prefixes']}", *_trade_lines(plan)]


def _forwards(plan: dict) -> str:
    """How far one forward goes, beside the expert cache and (where it is lent to a prompt) with it."""
    beside = f"a forward carries up to {plan['forward_tokens']:,} tokens"
    if plan["prompt_tokens"] <= plan["forward_tokens"]:
        return beside + " (a prompt that long reads each expert once)"
    spilled = (f"; up to {plan['spill_tokens']:,} with its rows' AttnRes blocks on the disk between layers "
               "(--no-spill: each further forward reads the experts again)" if plan.get("spill_tokens") else "")
    return (f"{beside} beside the expert cache, a prompt's up to {plan['prompt_tokens']:,} with the cache lent to "
            f"it (a prompt that long reads each expert once; decode takes the cache back, empty){spilled}")


def _trade_lines(plan: dict) -> list[str]:
    """The one-worker defaults' trade, as `inspect` prints it: each default given back, and what it costs."""
    lines = []
    for t in plan.get("trade", []):
        if "error" in t:
            lines.append(f"  with {t['flags']}: does not fit ({t['error']})")
            continue
        lines.append(f"  with {t['flags']}: {t['spine']} spine, {t['resident_layers']} layers resident, expert cache "
                     f"{_gb(t['expert_cache'])} (not {_gb(plan['expert_cache'])}), context {t['context']:,}, "
                     f"prompts in forwards of up to {t['prompt_tokens']:,} tokens, sessions {_gb(t['sessions'])} + "
                     f"prefixes {_gb(t['prefixes'])}, workspace {_gb(t['workspace'])}, spine read per token "
                     f"{_gb(t['spine_bytes_per_token'])}")
    if lines:
        lines.insert(0, f"  one worker, one user: one sequence of up to {plan['context']:,} tokens, and a prompt's "
                     "forward borrows the expert cache (a prompt longer than that forward spills, or takes several, "
                     "each reading its experts again); the defaults given back:")
    return lines


def _gb(n: int) -> str:
    return f"{n / 1e9:,.3f} GB" if n >= 1e8 else f"{n / 1e6:,.3f} MB"


def format_report(r: dict[str, Any]) -> str:
    ex = r["experts"]
    lines = [
        f"{r['model_dir']}: {r['model_type']}, {r['num_layers']} layers, hidden {r['hidden_size']}, "
        f"vocab {r['vocab_size']}",
        "",
        f"{'layer':>5}  {'attn':4}  {'ffn':5}  {'blocks':>6}  {'spine as stored':>28}  {'resident bf16':>13}",
    ]
    for layer in r["layers"]:
        stored = ", ".join(f"{k} {_gb(v)}" for k, v in sorted(layer["spine_bytes"].items()))
        lines.append(f"{layer['layer']:>5}  {layer['kind']:4}  {layer['ffn']:5}  {layer['attn_res_blocks']:>6}  "
                     f"{stored:>28}  {_gb(layer['resident_bytes'][stored_spine()]):>13}")
    sb = r["spine_bytes"]
    lines += [
        "",
        "spine: " + ", ".join(f"{k} {_gb(v)}" for k, v in sorted(sb["layers"].items()))
        + " in layers; top (embedding, head, norms): "
        + ", ".join(f"{k} {_gb(v)}" for k, v in sorted(sb["top"].items())) + f"; total {_gb(sb['total'])}",
        f"experts: {ex['format']}, {ex['per_layer']} per MoE layer x {len(r['moe_layers'])} layers, "
        f"{ex['active']} active; {ex['bytes_per_expert']:,} bytes each",
        f"expert bytes: {_gb(ex['total_bytes'])} in all; {_gb(ex['bytes_per_token'])} per token "
        f"at k={ex['active']} (no cache hits)",
        f"contiguous experts: {ex['contiguous']:,}, scattered: {ex['non_contiguous']:,}, "
        f"unreadable: {ex['unreadable']:,}"
        + ("  (one read per expert)" if ex["all_contiguous"] else ""),
    ]
    if r["unused_tensors"]:
        lines.append(f"unused by the text model (skipped): {r['unused_tensors']:,} tensors")
    lines += [f"spine format {name} left out: {why}" for name, why in r["unusable_spines"].items()]
    if r["plan"] is not None:
        lines += ["", *plan_lines(r["plan"], r["num_layers"])]
    if r.get("download"):
        lines += ["", r["download"]["summary"]]
    if r["problems"]:
        lines += ["", f"{len(r['problems'])} problem(s):"] + [f"  - {p}" for p in r["problems"]]
    elif not cannot_fit(r):
        lines += ["", "no problems found"]
    return "\n".join(lines)


def cannot_fit(r: dict[str, Any]) -> bool:
    """The report has a memory plan (`--memory-gb`), and it cannot fit: `inspect` then exits 1."""
    return r["plan"] is not None and "error" in r["plan"]
