"""Benchmarks that print JSON (`deltafin bench`): the disk, the MXFP4 kernels, and decode with experts
streamed from the disk, against the physical limit (PERF.md).

Decode is measured honestly: the disk is measured first with the same reader (same read size, same
threads, same I/O mode) on experts of the same checkpoint; decode then streams; `t_compute` replays the
same tokens with each token's experts loaded before its clock starts. Medians over tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltafin.devices import exact_fp32, resolve_device, resolve_dtype, synchronize
from deltafin.errors import DeltafinError
from deltafin.kernels.quant import MXFP4Weight
from deltafin.models.weights import ExpertWeights
from deltafin.weights.directio import ALIGN, align_down, align_up
from deltafin.weights.diskspeed import expert_read_speed, measure_reads
from deltafin.weights.reader import Extent, ReadPlan

K3_EXPERT = {"w1": (3072, 3584), "w2": (3584, 3072), "w3": (3072, 3584)}  # logical [rows, cols]
GB = 1e9


def _sustained_seconds(fn: Callable[[], object], device: torch.device, repeats: int, rounds: int = 5) -> float:
    """Seconds per call with calls issued back to back (one sync per round): sustained throughput, as in
    decode where launches queue up. Median over rounds."""
    for _ in range(3):
        fn()
    synchronize(device)
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        synchronize(device)
        per_call.append((time.perf_counter() - t0) / repeats)
    return statistics.median(per_call)


# ---- disk ---------------------------------------------------------------------------------------------


def bench_disk(path: str | Path, read_size: int = 17_547_264, threads: int = 8, io: str = "direct",
               total_bytes: int = 4 * 10**9, seed: int = 0) -> dict[str, Any]:
    """Random whole-block reads of `read_size` bytes from the files under `path` (at least 1 GB of them)."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    files = [f for f in files if f.stat().st_size >= read_size + ALIGN]
    if not files or sum(f.stat().st_size for f in files) < 10**9:
        raise DeltafinError(f"{path}: need at least 1 GB of files of {read_size} bytes or more to measure the disk "
                            "(use a checkpoint directory, or a large file)")
    rng = random.Random(seed)
    count = max(8, total_bytes // read_size)
    plans, seen = [], set()
    while len(plans) < count and len(seen) < 10 * count:
        f = rng.choice(files)
        start = align_down(rng.randrange(0, f.stat().st_size - read_size))
        if (f, start) in seen:
            continue
        seen.add((f, start))
        span = align_up(read_size)
        plans.append(ReadPlan((Extent(f, start, start + span, 0, span),), ()))
    return {"bench": "disk", "path": str(path), **measure_reads(plans, io, threads)}


# ---- kernels ------------------------------------------------------------------------------------------


def bench_mxfp4(device: str = "auto", dtype: str = "fp32", tokens: int = 1, repeats: int = 20) -> dict[str, Any]:
    """Dequant+matmul of one real-size K3 expert (3 x 3584x3072 MXFP4, 17.5 MB) against `tokens` inputs (with
    --kernels mlx: MLX's experts, one expert for `tokens` tokens and a decode layer's 16)."""
    from deltafin.checkpoint.config import parse_config
    from deltafin.kernels.linear import expert_backend, fast_path, mxfp4_linear
    from deltafin.mini.synth import preset_config
    from deltafin.models.moe import expert_ffn

    dev, dt = resolve_device(device), resolve_dtype(dtype)
    if expert_backend(dev.type) == "mlx":
        return bench_mlx_experts(tokens, repeats)
    if dt == torch.float32:
        exact_fp32()
    g = torch.Generator().manual_seed(0)
    mats = {name: MXFP4Weight(torch.randint(0, 256, (r, c // 2), dtype=torch.uint8, generator=g),
                              torch.randint(118, 122, (r, c // 32), dtype=torch.uint8, generator=g)).to(dev)
            for name, (r, c) in K3_EXPERT.items()}
    expert = ExpertWeights(mats["w1"], mats["w2"], mats["w3"])
    packed = sum(m.nbytes for m in mats.values())
    x = torch.randn(tokens, 3584, generator=g).to(dev, dt)
    w1 = mats["w1"]
    mxfp4_linear(x, w1)  # builds and self-checks the fast path
    t_matrix = _sustained_seconds(lambda: mxfp4_linear(x, w1), dev, repeats)
    cfg = parse_config(preset_config("k3-slice", 2))
    t_expert = _sustained_seconds(lambda: expert_ffn(cfg, expert, x), dev, repeats)
    fast = fast_path(dev.type)
    return {
        "bench": "mxfp4", "device": str(dev), "dtype": dtype, "tokens": tokens,
        "path": getattr(fast, "isa", type(fast).__name__) if fast is not None else "torch reference",
        "threads": torch.get_num_threads(),
        "matrix_ms": round(t_matrix * 1e3, 3),
        "matrix_packed_GBps": round(w1.nbytes / t_matrix / GB, 2),
        "expert_ms": round(t_expert * 1e3, 3),
        "expert_packed_GBps": round(packed / t_expert / GB, 2),
        "expert_bytes": packed,
    }


def bench_mlx_experts(tokens: int = 1, repeats: int = 20) -> dict[str, Any]:
    """MLX's experts at K3's width (kernels/mlx_moe.py): one expert for `tokens` tokens, and one token through
    the 16 experts of a decode layer, in one evaluation each. Packed GB/s of expert bytes read."""
    import mlx.core as mx

    from deltafin.checkpoint.config import parse_config
    from deltafin.kernels.mlx_moe import MLXSlots, run_experts
    from deltafin.mini.synth import preset_config
    from deltafin.models.common import activation

    cfg = parse_config(preset_config("k3-slice", 2))
    k = cfg.experts_per_token
    slots = MLXSlots(cfg, k)
    rng = np.random.default_rng(0)
    for s in range(k):  # random codes, scales near 2**-8 (valid E8M0)
        for j, region in enumerate(slots.regions(s)):
            np.frombuffer(region, dtype=np.uint8)[:] = rng.integers(0, 256, len(region), dtype=np.uint8) \
                if j % 2 == 0 else rng.integers(118, 122, len(region), dtype=np.uint8)
    act, g = activation(cfg), torch.Generator().manual_seed(0)
    z = torch.randn(tokens, cfg.expert_dim, generator=g)
    one = lambda: run_experts(slots, act, z, torch.zeros(tokens, 1, dtype=torch.long), torch.ones(tokens, 1),
                              lambda e: e)
    z1 = z[:1]
    layer = lambda: run_experts(slots, act, z1, torch.arange(k).view(1, k), torch.full((1, k), 1 / k), lambda e: e)
    cpu = torch.device("cpu")
    t_expert, t_layer = _sustained_seconds(one, cpu, repeats), _sustained_seconds(layer, cpu, repeats)
    expert_bytes = cfg.bytes_per_expert
    slots.release_memory()
    return {"bench": "mxfp4", "path": f"mlx {mx.__version__} ({mx.default_device()})", "tokens": tokens,
            "expert_ms": round(t_expert * 1e3, 3), "expert_packed_GBps": round(expert_bytes / t_expert / GB, 2),
            "layer_experts": k, "layer_ms": round(t_layer * 1e3, 3),
            "layer_packed_GBps": round(k * expert_bytes / t_layer / GB, 2), "expert_bytes": expert_bytes}


# ---- decode -------------------------------------------------------------------------------------------


class ExpertRecorder:
    """Wraps a stage's expert provider: records which experts each MoE layer asked for, per token."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.trace: list[tuple[int, list[int]]] = []

    def experts(self, layer: int, ids: list[int]) -> Any:
        self.trace.append((layer, list(ids)))
        return self.inner.experts(layer, ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def bench_decode(model: str | Path, tokens: int = 16, prompt: int = 4, device: str = "auto", dtype: str = "fp32",
                 options: Any = None, measure_disk: bool = True) -> dict[str, Any]:
    """Decode `tokens` greedily after a `prompt`-token prefill, the stage sized by `options` (StageOptions;
    default: everything resident). Reports the memory plan against the peak, bytes per token (experts,
    spine), and when anything streams the limit terms and the efficiency against them."""
    from deltafin.runtime.pipeline import LocalPipeline
    from deltafin.runtime.stage import SeqInput

    pipe = LocalPipeline.load(model, 1, device=device, dtype=dtype, options=options)
    stage = pipe.stages[0]
    cfg, dev, plan = stage.cfg, stage.device, stage.sizing
    opts = stage.options
    result = _decode_setup(model, stage, dtype)
    try:
        streams = plan.streaming or bool(plan.streamed_layers)
        if streams and measure_disk and cfg.moe_layers:
            result["disk"] = expert_read_speed(stage.ckpt, cfg.moe_layers, opts.read_threads, opts.io)
        recorder = ExpertRecorder(stage.experts)
        stage.experts = recorder
        ids = torch.arange(prompt) % (cfg.vocab_size - 256)
        t0 = time.perf_counter()
        pipe.forward([SeqInput("bench", 0, ids=ids)])
        synchronize(dev)
        result["prefill_s"] = round(time.perf_counter() - t0, 3)
        before = _io_counters(stage)
        recorder.trace.clear()
        inputs, times = _decode_steps(pipe, cfg, prompt, tokens, dev)
        result.update(_decode_numbers(times, before, _io_counters(stage), tokens))
        trace = list(recorder.trace)
        stage.experts = recorder.inner
        result.update(_peak_memory(dev, plan))
        if plan.streaming:
            result.update(_streaming_numbers(pipe, stage, ids, inputs, trace, result))
    finally:
        pipe.close()
    return result


def _decode_setup(model: str | Path, stage: Any, dtype: str) -> dict[str, Any]:
    """What a decode benchmark ran: the model's shape, the stage's options and its memory plan."""
    cfg, plan, opts = stage.cfg, stage.sizing, stage.options
    return {
        "bench": "decode", "model": str(Path(model).resolve()), "device": str(stage.device), "dtype": dtype,
        "layers": cfg.num_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
        "moe_layers": len(cfg.moe_layers), "experts_per_token": cfg.experts_per_token,
        "expert_bytes": cfg.bytes_per_expert, "io": opts.io, "read_threads": opts.read_threads,
        "policy": opts.cache_policy, "prefetch": opts.prefetch,
        "memory_budget_gb": None if opts.memory_bytes is None else round(opts.memory_bytes / GB, 3),
        "spine": plan.spine, "experts_streamed": plan.streaming, "expert_cache_gb": round(plan.expert_cache / GB, 3),
        "spine_resident_layers": len(plan.resident_layers), "spine_streamed_layers": len(plan.streamed_layers),
        "plan_gb": {k: round(v / GB, 3) for k, v in plan.as_dict().items() if isinstance(v, int)
                    and not isinstance(v, bool) and k not in ("start", "end", "forward_tokens")}}


def bench_prefill(model: str | Path, lengths: Iterable[int], device: str = "auto", dtype: str = "fp32",
                  options: Any = None, measure_disk: bool = True) -> dict[str, Any]:
    """Prefill prompts of each length in forwards of the stage's limit (as the engine sends them): per length
    the seconds and tok/s, the forwards, the experts loaded from the disk (a layer's expert once per forward
    that touches it, unless the cache kept it), the expert and spine bytes read (experts also as a multiple of
    all of them: about 1 when each is read once, the forwards' count when every forward re-reads them), and the
    peak memory during that prompt against the plan. When anything streams, the disk is measured first with
    the same reader, and each length gets its disk-limited time (bytes read / disk speed) and `vs_disk`, that
    time over the measured one; `t_compute_s` is the time the stage did not wait for reads, and `efficiency`
    the larger of the two limits over the measured time (PERF.md). The ids are i % 700 + 5, the prompt
    tests/reference/peer/prefill_llamacpp.py gives llama.cpp."""
    from deltafin.runtime.pipeline import LocalPipeline
    from deltafin.runtime.stage import SeqInput, StageOptions

    options = options or StageOptions()
    pipe = LocalPipeline.load(model, 1, device=device, dtype=dtype, options=options)
    stage = pipe.stages[0]
    cfg, dev, plan = stage.cfg, stage.device, stage.sizing
    chunk = pipe.max_forward_tokens or options.max_forward_tokens
    all_experts = len(cfg.moe_layers) * cfg.num_experts * cfg.bytes_per_expert
    out: dict[str, Any] = {}
    result: dict[str, Any] = {"bench": "prefill", "runtime": "deltafin", "model": str(Path(model).resolve()),
                              "device": str(dev), "dtype": dtype, "threads": torch.get_num_threads(), "chunk": chunk,
                              "experts_streamed": plan.streaming, "all_experts_gb": round(all_experts / GB, 3)}
    try:
        if measure_disk and (plan.streaming or plan.streamed_layers):
            result["disk"] = expert_read_speed(stage.ckpt, cfg.moe_layers, stage.options.read_threads,
                                               stage.options.io)
        # first-call costs (kernel builds); two tokens, since at K3's size 64 would read most of the experts
        pipe.forward([SeqInput("warm-up", 0, ids=torch.arange(2) + 5)])
        pipe.release("warm-up")
        disk = result.get("disk", {}).get("disk_GBps")
        for n in lengths:
            out[str(n)] = _prefill_one(pipe, n, chunk, all_experts, disk)
        result["lengths"] = out
        result.update(_peak_memory(dev, plan))
    finally:
        pipe.close()
    return result


def _prefill_one(pipe: Any, n: int, chunk: int, all_experts: int, disk: float | None) -> dict[str, Any]:
    """One prompt of `n` tokens through `pipe` in forwards of `chunk`: its numbers (bench_prefill)."""
    from deltafin.runtime.stage import SeqInput

    stage = pipe.stages[0]
    ids = torch.arange(n) % 700 + 5
    name = f"prefill-{n}"
    _reset_peak_rss()
    before = _io_counters(stage)
    t0 = time.perf_counter()
    for pos in range(0, n, chunk):
        pipe.forward([SeqInput(name, pos, ids=ids[pos:pos + chunk])])
    synchronize(stage.device)
    seconds = time.perf_counter() - t0
    after = _io_counters(stage)
    pipe.release(name)
    experts, spine = after["expert_bytes"] - before["expert_bytes"], after["spine_bytes"] - before["spine_bytes"]
    loads = (after["lookups"] - before["lookups"]) - (after["hits"] - before["hits"])
    row: dict[str, Any] = {"seconds": round(seconds, 3), "tok_per_s": round(n / seconds, 1),
                           "forwards": -(-n // chunk), "expert_loads": loads, "expert_bytes": experts,
                           "spine_bytes": spine, "x_all_experts": round(experts / all_experts, 3)}
    waited = after["io_wait"] - before["io_wait"]  # the stage waiting for reads: the rest is its compute
    row.update({"io_wait_s": round(waited, 3), "t_compute_s": round(seconds - waited, 3)})
    if disk:
        limit = (experts + spine) / (disk * GB)
        row.update({"t_disk_limit_s": round(limit, 3), "vs_disk": round(limit / seconds, 3),
                    "efficiency": round(max(limit, seconds - waited) / seconds, 3)})
    peak = _peak_rss()
    if peak is not None:
        row["peak_rss_gb"] = round(peak / GB, 3)
    return row


def _reset_peak_rss() -> None:
    """Start a new peak-RSS window (Linux: /proc/self/clear_refs; elsewhere the peak stays the process's)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _peak_rss() -> int | None:
    """The resident peak since the last _reset_peak_rss (Linux's VmHWM), or None where there is none."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    return int(found.group(1)) * 1024 if found else None


def _verify_pass(pipe: Any, pos: int, ids: torch.Tensor) -> tuple[float, int, int]:
    """One speculative forward of `ids` at `pos` (after the first token of the last one): seconds, expert
    bytes and streamed spine bytes it read."""
    from deltafin.runtime.stage import SeqInput

    stage = pipe.stages[0]
    before = _io_counters(stage)
    t0 = time.perf_counter()
    pipe.forward([SeqInput("verify", pos, ids=ids, speculative=True)])
    synchronize(stage.device)
    seconds = time.perf_counter() - t0
    after = _io_counters(stage)
    return seconds, after["expert_bytes"] - before["expert_bytes"], after["spine_bytes"] - before["spine_bytes"]


def bench_verify(model: str | Path, drafts: Iterable[int], device: str = "auto", dtype: str = "fp32",
                 options: Any = None, prompt: int = 16, repeats: int = 3) -> dict[str, Any]:
    """One speculative verification pass (the last token and k drafts in one forward) for each k: its
    seconds and the bytes it reads, experts and streamed spine apart, the median of `repeats` passes. Every
    pass continues after the first token of the one before (its drafts rejected), so the context grows by
    one token a pass; the ids are seeded random tokens, so each pass routes to fresh experts as a new text
    would."""
    from deltafin.runtime.pipeline import LocalPipeline
    from deltafin.runtime.stage import SeqInput
    from deltafin.text.drafting import distinct_experts

    pipe = LocalPipeline.load(model, 1, device=device, dtype=dtype, options=options)
    stage, cfg = pipe.stages[0], pipe.stages[0].cfg
    dev = stage.device
    rng = torch.Generator().manual_seed(0)
    vocab = cfg.vocab_size - 256
    passes: dict[str, Any] = {}
    try:
        pipe.forward([SeqInput("verify", 0, ids=torch.randint(0, vocab, (prompt,), generator=rng))])
        pipe.forward([SeqInput("verify", prompt, ids=torch.randint(0, vocab, (2,), generator=rng), speculative=True)])
        pos = prompt + 1  # warm: first-call costs paid
        for k in [0, *(k for k in drafts if k)]:  # k = 0: a plain one-token step, the baseline
            runs = []
            for _ in range(repeats):
                runs.append(_verify_pass(pipe, pos, torch.randint(0, vocab, (k + 1,), generator=rng)))
                pos += 1
            seconds, experts, spine = (statistics.median(r[i] for r in runs) for i in range(3))
            passes[str(k)] = {"tokens": k + 1, "seconds": round(seconds, 3), "expert_gb": round(experts / GB, 3),
                              "spine_gb": round(spine / GB, 3),
                              "uniform_router_experts_per_layer": round(distinct_experts(
                                  k + 1, cfg.num_experts, cfg.experts_per_token), 1)}
        pipe.release("verify")
        result = {"bench": "verify", "model": str(Path(model).resolve()), "device": str(dev), "dtype": dtype,
                  "prompt": prompt, "repeats": repeats, "moe_layers": len(cfg.moe_layers),
                  "passes": passes}
        result.update(_peak_memory(dev, stage.sizing))
    finally:
        pipe.close()
    return result


async def _turn(engine: Any, ids: list[int], n: int) -> tuple[list[int], float, int]:
    """One request through the serving engine: its tokens, time to first token, prompt tokens resumed."""
    from deltafin.coordinator.engine.token_loop import Finished

    t0, ttft, out, cached = time.perf_counter(), 0.0, [], 0
    async for e in engine.run(ids, None, max_tokens=n, ignore_eos=True):
        if isinstance(e, Finished):
            cached = e.usage.cached_tokens
        else:
            ttft = ttft or time.perf_counter() - t0
            out.append(e.token_id)
    return out, ttft, cached


def bench_second_turn(model: str | Path, prompt: int, new: int, device: str = "auto", dtype: str = "fp32",
                      options: Any = None, reply: int = 4) -> dict[str, Any]:
    """A chat's second turn: a `prompt`-token first request generates `reply` tokens; the second request is
    all of that plus `new` tokens. Its time to first token with the prefix cache (resumed from the first
    request's kept state) and without (everything prefilled), through the serving engine in process, the
    stages sized by `options`. The ids are seeded random tokens (a real conversation's would do the same)."""
    import asyncio

    from deltafin.coordinator.cluster.backend import LocalBackend
    from deltafin.coordinator.engine.engine import Engine
    from deltafin.runtime.pipeline import LocalPipeline
    from deltafin.text.tokenizer import K3Tokenizer

    pipe = LocalPipeline.load(model, 1, device=device, dtype=dtype, options=options)
    cfg, tok = pipe.stages[0].cfg, K3Tokenizer.load(model)
    rng = torch.Generator().manual_seed(0)
    first = torch.randint(0, cfg.vocab_size - 256, (prompt,), generator=rng).tolist()
    extra = torch.randint(0, cfg.vocab_size - 256, (new,), generator=rng).tolist()

    async def run() -> dict[str, Any]:
        engine = Engine(LocalBackend(pipe), tok, cfg, "bench", prefix_cache=True)
        try:
            reply_ids, ttft1, _ = await _turn(engine, first, reply)
            second = first + reply_ids + extra
            with_cache = await _turn(engine, second, 1)
            engine.prefixes = None  # the same stages, no reuse
            without = await _turn(engine, second, 1)
        finally:
            await engine.close()
        return {"first_turn_ttft_s": round(ttft1, 3), "second_turn_tokens": len(second),
                "with_cache": {"ttft_s": round(with_cache[1], 3), "cached_tokens": with_cache[2]},
                "without_cache": {"ttft_s": round(without[1], 3), "cached_tokens": without[2]},
                "same_first_token": with_cache[0] == without[0],
                "speedup": round(without[1] / with_cache[1], 2)}

    result = {"bench": "second_turn", "model": str(Path(model).resolve()), "device": str(pipe.stages[0].device),
              "dtype": dtype, "prompt": prompt, "reply": reply, "new": new,
              "chunk": pipe.max_forward_tokens, **asyncio.run(run())}
    result.update(_peak_memory(pipe.stages[0].device, pipe.stages[0].sizing))
    return result


def _decode_steps(pipe: Any, cfg: Any, prompt: int, tokens: int, dev: torch.device) -> tuple[list, list[float]]:
    """Decode steps feed seeded random ids: a random-weight model's greedy output repeats itself, and repeated
    tokens route to the same experts, which would flatter the cache."""
    from deltafin.runtime.stage import SeqInput

    rng = torch.Generator().manual_seed(0)
    inputs, times = [], []
    for n in range(prompt, prompt + tokens):
        nxt = torch.randint(0, cfg.vocab_size - 256, (1,), generator=rng)
        inputs.append(nxt)
        t0 = time.perf_counter()
        pipe.forward([SeqInput("bench", n, ids=nxt)])
        synchronize(dev)
        times.append(time.perf_counter() - t0)
    return inputs, times


def _peak_memory(dev: torch.device, plan: Any) -> dict[str, Any]:
    """The process's peak resident memory (and the GPU's peak allocation) against the plan."""
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    out: dict[str, Any] = {"peak_rss_gb": round(rss / GB, 3), "planned_gb": round(plan.total / GB, 3)}
    if dev.type == "cuda":
        out["peak_cuda_allocated_gb"] = round(torch.cuda.max_memory_allocated(dev) / GB, 3)
        out["planned_device_gb"] = round(plan.device_total / GB, 3)
    return out


def _streaming_numbers(pipe: Any, stage: Any, ids: torch.Tensor, inputs: list, trace: list,
                       result: dict[str, Any]) -> dict[str, Any]:
    from deltafin.weights.expert_cache import POLICIES, simulate

    cfg = stage.cfg
    capacity = max(1, stage.sizing.expert_cache // cfg.bytes_per_expert)
    steps = [[(layer, e) for e in ids_] for layer, ids_ in trace]
    out: dict[str, Any] = {"policy_hit_rates": {p: round(simulate(p, capacity, steps), 4) for p in POLICIES}}
    t_compute = _replay(pipe, stage, ids, inputs)
    out["t_compute_s"] = round(t_compute, 4)
    disk = result.get("disk", {}).get("disk_GBps")
    if disk:
        t_io = result["bytes_read_per_token"] / (disk * GB)
        out["t_io_limit_s"] = round(t_io, 4)
        out["efficiency"] = round(max(t_io, t_compute) / result["s_per_token_median"], 3)
        out["read_GBps_vs_disk"] = round(result["read_GBps_achieved"] / disk, 3)
        if result.get("spine_read_GBps"):
            out["spine_read_GBps_vs_disk"] = round(result["spine_read_GBps"] / disk, 3)
    return out


def _io_counters(stage: Any) -> dict[str, float]:
    s = stage.stats()
    ex = s.get("experts", {})
    return {"bytes": ex.get("bytes_read", 0) + s["spine_streamed_bytes"], "expert_bytes": ex.get("bytes_read", 0),
            "spine_bytes": s["spine_streamed_bytes"], "spine_read_s": s["spine_read_s"],
            "lookups": ex.get("lookups", 0),
            "hits": ex.get("hits", 0), "prefetch_hits": ex.get("prefetch_hits", 0), "misses": ex.get("misses", 0),
            "io_wait": ex.get("io_wait_s", 0.0) + s["spine_wait_s"], "seconds": s["seconds"],
            "wasted": ex.get("wasted_bytes", 0), "prefetch_bytes": ex.get("prefetch_bytes", 0)}


def _decode_numbers(times: list[float], before: dict[str, float], after: dict[str, float],
                    tokens: int) -> dict[str, Any]:
    d = {k: after[k] - before[k] for k in after}
    total = sum(times)
    median = statistics.median(times)
    lookups = max(1, d["lookups"])
    want = d["prefetch_hits"] + d["misses"]
    return {
        "tokens": tokens,
        "tok_per_s": round(tokens / total, 4),
        "s_per_token_median": round(median, 4),
        "s_per_token_min": round(min(times), 4),
        "bytes_read_per_token": int(d["bytes"] / tokens),
        "expert_bytes_read_per_token": int(d["expert_bytes"] / tokens),
        "spine_bytes_per_token": int(d["spine_bytes"] / tokens),
        "spine_read_GBps": round(d["spine_bytes"] / d["spine_read_s"] / GB, 3) if d["spine_read_s"] else None,
        "read_GBps_achieved": round(d["bytes"] / total / GB, 3),
        "cache_hit_rate": round(d["hits"] / lookups, 4),
        "prefetch_recall": round(d["prefetch_hits"] / want, 4) if want else None,
        "prefetch_wasted_bytes_per_token": int(d["wasted"] / tokens),
        "io_wait_s_per_token": round(d["io_wait"] / tokens, 4),
        "compute_s_per_token": round((d["seconds"] - d["io_wait"]) / tokens, 4),
    }


def _replay(pipe: Any, stage: Any, prompt_ids: torch.Tensor, inputs: list[torch.Tensor]) -> float:
    """t_compute: the same tokens again, with every wait for the disk taken out of their clocks: each MoE
    layer's experts are read when it asks (one layer's worth in memory at a time, so this holds at full
    scale), that read's time and the streamed spine's wait are subtracted. Median over tokens."""
    from deltafin.runtime.stage import SeqInput

    original, options = stage.experts, stage.options
    loading = _LoadedOnDemand(stage)
    try:
        pipe.forward([SeqInput("replay", 0, ids=prompt_ids)])  # untimed, streamed as before: the same caches
        stage.experts, stage.options = loading, dataclasses.replace(options, prefetch=False)
        times = []
        for i, nxt in enumerate(inputs):
            loading.seconds, spine_wait = 0.0, stage.spine.wait_s
            t0 = time.perf_counter()
            pipe.forward([SeqInput("replay", len(prompt_ids) + i, ids=nxt)])
            synchronize(stage.device)
            times.append(time.perf_counter() - t0 - loading.seconds - (stage.spine.wait_s - spine_wait))
        return statistics.median(times)
    finally:
        stage.experts, stage.options = original, options
        loading.close()


class _LoadedOnDemand:
    """An expert provider that reads a layer's experts when the layer asks (direct I/O into its own slots, as
    the store reads), and counts the time it took."""

    def __init__(self, stage: Any):
        from deltafin.plan.sizing import expert_slot_bytes
        from deltafin.weights.reader import ShardFiles, SlotPool

        self.stage = stage
        self.files = ShardFiles(stage.options.io)
        self.pool = SlotPool(stage.cfg.experts_per_token, expert_slot_bytes(stage.cfg))
        self.seconds = 0.0

    def experts(self, layer: int, ids: list[int]) -> Iterable[tuple[int, ExpertWeights]]:
        from deltafin.weights.reader import plan_read
        from deltafin.weights.tensors import expert_views

        dev = self.stage.device
        for start in range(0, len(ids), self.pool.count):  # a slot per expert, a pool's worth at a time
            t0 = time.perf_counter()
            batch = []
            for slot, e in enumerate(ids[start:start + self.pool.count]):
                plan = plan_read(self.stage.ckpt.expert(layer, e))
                self.files.read_into(plan, self.pool.memory(slot))
                w = expert_views(self.stage.cfg, plan.tensors, torch.frombuffer(self.pool.memory(slot),
                                                                                 dtype=torch.uint8))
                batch.append((e, ExpertWeights(w.w1.to(dev), w.w2.to(dev), w.w3.to(dev))))
            synchronize(dev)
            self.seconds += time.perf_counter() - t0
            yield from batch

    def close(self) -> None:
        self.files.close()
