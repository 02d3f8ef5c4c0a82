"""Model benchmarks that print JSON (`deltafin bench --model`): decode with experts streamed from the disk,
prefill, speculative verification and a chat's second turn, against the physical limit (docs/PERF.md). The kernel
and disk micro-benchmarks are bench_kernels.py's.

Decode is measured honestly: the disk is measured first with the same reader (same read size, same
threads, same I/O mode) on experts of the same checkpoint; decode then streams; `t_compute` replays the
same tokens with each token's experts loaded before its clock starts. Medians over tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from deltafin.coordinator.cluster.backend import LocalBackend
from deltafin.coordinator.engine.engine import Engine
from deltafin.coordinator.engine.events import Finished
from deltafin.coordinator.engine.generation import Generation
from deltafin.devices import synchronize
from deltafin.errors import DeltafinError
from deltafin.models.weights import ExpertWeights
from deltafin.options import CACHE_POLICIES
from deltafin.plan.memory.stage_parts import expert_slot_bytes
from deltafin.plan.timing.predict import forward_lengths
from deltafin.runtime.memory import peak_rss
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import StageOptions
from deltafin.text.drafting import distinct_experts
from deltafin.text.tokenizer import K3Tokenizer
from deltafin.weights.diskspeed import expert_read_speed
from deltafin.weights.expert_cache import simulate
from deltafin.weights.expert_stats import ExpertStats
from deltafin.weights.expert_trace import ExpertRecorder
from deltafin.weights.reader import ReadPlan, ShardFiles, SlotPool
from deltafin.weights.tensors import expert_views

GB = 1e9


# ---- decode -------------------------------------------------------------------------------------------


def bench_decode(model: str | Path, tokens: int = 16, prompt: int = 4, device: str = "auto", dtype: str = "fp32",
                 options: Any = None, measure_disk: bool = True, seed: int = 0) -> dict[str, Any]:
    """Decode `tokens` greedily after a `prompt`-token prefill, the stage sized by `options` (StageOptions;
    default: everything resident). Reports the load's seconds, the memory plan against the peak, bytes per token
    (experts, spine), and when anything streams the limit terms and the efficiency against them. `seed`: the
    decoded tokens' random ids (and, but for 0, the prompt's)."""
    pipe, loaded = _load(model, device, dtype, options)
    stage = pipe.stages[0]
    cfg, dev, plan = stage.cfg, stage.device, stage.plan
    opts = stage.options
    result = {**_decode_setup(model, stage, dtype), **loaded}
    try:
        streams = plan.streaming or bool(plan.streamed_layers)
        if streams and measure_disk and cfg.moe_layers:
            result["disk"] = expert_read_speed(stage.ckpt, cfg.moe_layers, opts.sizing.read_threads, opts.io)
        recorder = ExpertRecorder(stage.experts)
        stage.experts = recorder
        ids = torch.arange(prompt) if not seed else torch.randint(0, cfg.vocab_size - 256, (prompt,),
                                                                  generator=torch.Generator().manual_seed(seed))
        ids = ids % (cfg.vocab_size - 256)
        result.update(_prefill_timed(pipe, stage, ids))
        before = _io_counters(stage)
        recorder.trace.clear()
        inputs, times = _decode_steps(pipe, cfg, prompt, tokens, dev, seed)
        result.update(_decode_numbers(times, before, _io_counters(stage), tokens))
        trace = list(recorder.trace)
        stage.experts = recorder.inner
        result.update(_peak_memory(dev, plan))
        if plan.streaming:
            result.update(_streaming_numbers(pipe, stage, ids, inputs, trace, result))
    finally:
        pipe.close()
    return result


def _load(model: str | Path, device: str, dtype: str, options: Any) -> tuple[LocalPipeline, dict[str, Any]]:
    """The pipeline, timed (`load_s`), once its stores have finished warming their caches from the experts' remembered
    heat (its reads are not the benchmark's): how many experts that read (`warmed_experts`), in how long."""
    t0 = time.perf_counter()
    pipe = LocalPipeline.load(model, 1, device=device, dtype=dtype, options=options)
    out: dict[str, Any] = {"load_s": round(time.perf_counter() - t0, 3)}
    warmers = [w for w in (getattr(s.experts, "warmer", None) for s in pipe.stages) if w is not None]
    for w in warmers:
        w.done.wait()
    if warmers:
        out.update(warmed_experts=sum(w.warmed for w in warmers), warm_s=round(max(w.seconds for w in warmers), 3))
    return pipe, out


def _prefill_timed(pipe: Any, stage: Any, ids: torch.Tensor) -> dict[str, Any]:
    """The prompt's forward: its seconds, and its experts' cache hit rate (the first tokens' after a start)."""
    before = _io_counters(stage)
    t0 = time.perf_counter()
    pipe.forward([SeqInput("bench", 0, ids=ids)])
    synchronize(stage.device)
    out: dict[str, Any] = {"prefill_s": round(time.perf_counter() - t0, 3)}
    after = _io_counters(stage)
    lookups = after["lookups"] - before["lookups"]
    out["prefill_hit_rate"] = round((after["hits"] - before["hits"]) / lookups, 4) if lookups else None
    return out


def bench_heat(model: str | Path, tokens: int = 16, prompt: int = 4, device: str = "auto", dtype: str = "fp32",
               options: Any = None, measure_disk: bool = True) -> dict[str, Any]:
    """The expert cache's hit rate without and with remembered heat, each run in a pipeline of its own (a restarted
    process's state). The first run starts with no heat (a heat folder of its own, so the user's is neither used
    nor changed), decodes seeded random tokens and saves what its layers used at close; the second warms its cache
    from that heat (timing starts once warming has finished; `warmed_experts` says how many it read) and decodes
    other seeded tokens, so the heat is the same model's traffic, not a replay of the tokens measured."""
    with tempfile.TemporaryDirectory(prefix="deltafin-heat-") as folder:
        opts = (options or StageOptions()).replace(expert_heat_dir=folder)
        cold = bench_decode(model, tokens, prompt, device, dtype, opts, measure_disk, seed=0)
        if not cold["experts_streamed"]:
            raise DeltafinError("bench --heat: this plan holds every expert in memory, so there is no cache to warm "
                                "(give --expert-cache-gb or a smaller --memory-gb)")
        warm = bench_decode(model, tokens, prompt, device, dtype, opts, measure_disk=False, seed=1)
    keys = ("cache_hit_rate", "prefill_hit_rate", "s_per_token_median", "load_s", "warmed_experts")
    return {"bench": "heat", "model": cold["model"], "device": cold["device"], "tokens": tokens, "prompt": prompt,
            "expert_cache_gb": cold["expert_cache_gb"], "cache_experts": cold["cache_experts"],
            "hit_rate_cold": cold["cache_hit_rate"], "hit_rate_warm": warm["cache_hit_rate"],
            "prefill_hit_rate_cold": cold["prefill_hit_rate"], "prefill_hit_rate_warm": warm["prefill_hit_rate"],
            "warmed_experts": warm["warmed_experts"], "warm_s": warm["warm_s"],
            "cold": {k: cold[k] for k in keys}, "warm": {k: warm[k] for k in keys}}


def _decode_setup(model: str | Path, stage: Any, dtype: str) -> dict[str, Any]:
    """What a decode benchmark ran: the model's shape, the stage's options and its memory plan."""
    cfg, plan, opts = stage.cfg, stage.plan, stage.options
    return {
        "bench": "decode", "model": str(Path(model).resolve()), "device": str(stage.device), "dtype": dtype,
        "layers": cfg.num_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
        "moe_layers": len(cfg.moe_layers), "experts_per_token": cfg.experts_per_token,
        "expert_bytes": cfg.bytes_per_expert, "io": opts.io, "read_threads": opts.sizing.read_threads,
        "policy": opts.cache_policy, "prefetch": opts.prefetch,
        "memory_budget_gb": None if opts.memory_bytes is None else round(opts.memory_bytes / GB, 3),
        "spine": plan.spine, "experts_streamed": plan.streaming, "expert_cache_gb": round(plan.expert_cache / GB, 3),
        "cache_experts": plan.expert_cache // expert_slot_bytes(cfg) if plan.streaming else None,
        "spine_resident_layers": len(plan.resident_layers), "spine_streamed_layers": len(plan.streamed_layers),
        "plan_gb": {k: round(v / GB, 3) for k, v in plan.as_dict().items() if isinstance(v, int)
                    and not isinstance(v, bool) and k not in ("start", "end", "forward_tokens", "sequences")}}


def bench_prefill(model: str | Path, lengths: Iterable[int], device: str = "auto", dtype: str = "fp32",
                  options: Any = None, measure_disk: bool = True) -> dict[str, Any]:
    """Prefill prompts of each length in forwards of the stage's limit (as the engine sends them): per length
    the seconds and tok/s, the forwards, the experts loaded from the disk (a layer's expert once per forward
    that touches it, unless the cache kept it), the expert and spine bytes read (experts also as a multiple of
    all of them: about 1 when each is read once, the forwards' count when every forward re-reads them), and the
    peak memory during that prompt against the plan. When anything streams, the disk is measured first with
    the same reader, and each length gets its disk-limited time (bytes read / disk speed) and `vs_disk`, that
    time over the measured one; `t_compute_s` is the time the stage did not wait for reads, and `efficiency`
    the larger of the two limits over the measured time (docs/PERF.md). The ids are i % 700 + 5, the prompt
    tests/reference/peer/prefill_llamacpp.py gives llama.cpp."""
    options = options or StageOptions()
    pipe, loaded = _load(model, device, dtype, options)
    stage = pipe.stages[0]
    cfg, dev, plan = stage.cfg, stage.device, stage.plan
    chunk = pipe.max_forward_tokens or options.sizing.prefill_chunk
    all_experts = len(cfg.moe_layers) * cfg.num_experts * cfg.bytes_per_expert
    out: dict[str, Any] = {}
    result: dict[str, Any] = {"bench": "prefill", "runtime": "deltafin", "model": str(Path(model).resolve()),
                              "device": str(dev), "dtype": dtype, "threads": torch.get_num_threads(), "chunk": chunk,
                              "experts_streamed": plan.streaming, "all_experts_gb": round(all_experts / GB, 3),
                              **loaded}
    try:
        if measure_disk and (plan.streaming or plan.streamed_layers):
            result["disk"] = expert_read_speed(stage.ckpt, cfg.moe_layers, stage.options.sizing.read_threads,
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
    stage = pipe.stages[0]
    ids = torch.arange(n) % 700 + 5
    name = f"prefill-{n}"
    _reset_peak_rss()
    before = _io_counters(stage)
    t0 = time.perf_counter()
    lengths = forward_lengths(n, chunk)  # as the coordinator cuts a prompt
    for pos, length in zip(itertools.accumulate([0, *lengths]), lengths, strict=False):
        pipe.forward([SeqInput(name, pos, ids=ids[pos:pos + length])])
    synchronize(stage.device)
    seconds = time.perf_counter() - t0
    after = _io_counters(stage)
    pipe.release(name)
    experts, spine = after["expert_bytes"] - before["expert_bytes"], after["spine_bytes"] - before["spine_bytes"]
    loads = (after["lookups"] - before["lookups"]) - (after["hits"] - before["hits"])
    row: dict[str, Any] = {"seconds": round(seconds, 3), "tok_per_s": round(n / seconds, 1),
                           "forwards": len(lengths), "expert_loads": loads, "expert_bytes": experts,
                           "spine_bytes": spine, "x_all_experts": round(experts / all_experts, 3)}
    spilled = {k: after[k] - before[k] for k in ("spilled_forwards", "spill_bytes_read", "spill_bytes_written")}
    if spilled["spilled_forwards"]:  # its rows' blocks went to the disk and back (runtime/spill.py)
        row.update(spilled, spill_s=round(after["spill_s"] - before["spill_s"], 3))
    waited = after["io_wait"] - before["io_wait"]  # the stage waiting for reads: the rest is its compute
    row.update({"io_wait_s": round(waited, 3), "t_compute_s": round(seconds - waited, 3)})
    if disk:
        limit = (experts + spine + spilled["spill_bytes_read"] + spilled["spill_bytes_written"]) / (disk * GB)
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
        result.update(_peak_memory(dev, stage.plan))
    finally:
        pipe.close()
    return result


async def _turn(engine: Any, ids: list[int], n: int) -> tuple[list[int], float, int]:
    """One request through the serving engine: its tokens, time to first token, prompt tokens resumed."""
    t0, ttft, out, cached = time.perf_counter(), 0.0, [], 0
    async for e in engine.run(ids, None, Generation(n, ignore_eos=True)):
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
    result.update(_peak_memory(pipe.stages[0].device, pipe.stages[0].plan))
    return result


def _decode_steps(pipe: Any, cfg: Any, prompt: int, tokens: int, dev: torch.device,
                  seed: int = 0) -> tuple[list, list[float]]:
    """Decode steps feed seeded random ids: a random-weight model's greedy output repeats itself, and repeated
    tokens route to the same experts, which would flatter the cache."""
    rng = torch.Generator().manual_seed(seed)
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
    rss = peak_rss()
    out: dict[str, Any] = {"peak_rss_gb": round(rss / GB, 3), "planned_gb": round(plan.total / GB, 3)}
    if dev.type == "cuda":
        out["peak_cuda_allocated_gb"] = round(torch.cuda.max_memory_allocated(dev) / GB, 3)
        out["planned_device_gb"] = round(plan.device_total / GB, 3)
    return out


def _streaming_numbers(pipe: Any, stage: Any, ids: torch.Tensor, inputs: list, trace: list,
                       result: dict[str, Any]) -> dict[str, Any]:
    cfg = stage.cfg
    capacity = max(1, stage.plan.expert_cache // cfg.bytes_per_expert)
    steps = [[(layer, e) for e in ids_] for layer, ids_ in trace]
    out: dict[str, Any] = {"policy_hit_rates": {p: round(simulate(p, capacity, steps), 4) for p in CACHE_POLICIES}}
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
    ex = s.experts or ExpertStats()
    return {"bytes": ex.bytes_read + s.spine_streamed_bytes, "expert_bytes": ex.bytes_read,
            "spine_bytes": s.spine_streamed_bytes, "spine_read_s": s.spine_read_s, "lookups": ex.lookups,
            "hits": ex.hits, "prefetch_hits": ex.prefetch_hits, "misses": ex.misses,
            "io_wait": ex.io_wait_s + s.spine_wait_s, "seconds": s.seconds, "wasted": ex.wasted_bytes,
            "prefetch_bytes": ex.prefetch_bytes, "spilled_forwards": s.spilled_forwards,
            "spill_bytes_read": s.spill_bytes_read, "spill_bytes_written": s.spill_bytes_written,
            "spill_s": s.spill_s}


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
    original, options = stage.experts, stage.options
    loading = _LoadedOnDemand(stage, original.readers.plan)
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
    the store reads: `where` finds an expert, a low-bit copy's too), and counts the time it took."""

    def __init__(self, stage: Any, where: Callable[[tuple[int, int]], tuple[Any, ReadPlan]]):
        self.stage, self.where = stage, where
        self.files = ShardFiles(stage.options.io)
        self.pool = SlotPool(stage.cfg.experts_per_token, expert_slot_bytes(stage.cfg))
        self.seconds = 0.0

    def experts(self, layer: int, ids: list[int]) -> Iterable[tuple[int, ExpertWeights]]:
        dev = self.stage.device
        for start in range(0, len(ids), self.pool.count):  # a slot per expert, a pool's worth at a time
            t0 = time.perf_counter()
            batch = []
            for slot, e in enumerate(ids[start:start + self.pool.count]):
                plan = self.where((layer, e))[1]
                self.files.read_into(plan, self.pool.memory(slot))
                w = expert_views(self.stage.cfg, plan.tensors, torch.frombuffer(self.pool.memory(slot),
                                                                                 dtype=torch.uint8), fmt=plan.fmt)
                batch.append((e, ExpertWeights(w.w1.to(dev), w.w2.to(dev), w.w3.to(dev))))
            synchronize(dev)
            self.seconds += time.perf_counter() - t0
            yield from batch

    def close(self) -> None:
        self.files.close()
