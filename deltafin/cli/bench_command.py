"""`deltafin bench`: the benchmarks that print JSON (a model's decode, prompt, drafting, heat, workload and quality;
the disk's reads; the kernels), each run when its flags say.
"""

from __future__ import annotations

import argparse
import json

from deltafin.cli.flags import (
    MODEL_HELP,
    add_device_options,
    add_stage_options,
    model_arg,
    stage_within_memory,
)
from deltafin.errors import DeltafinError
from deltafin.expert_modes import EXACT
from deltafin.formats import converted_spines
from deltafin.options import WIRES


def _cmd_bench(args: argparse.Namespace) -> int:
    from deltafin.cli import bench_kernels  # torch: loaded when the command runs
    from deltafin.kernels.linear import select_kernels  # (the same)

    if args.disk:
        result = bench_kernels.bench_disk(args.disk, threads=args.read_threads, io=args.io)
    elif args.kernel:
        select_kernels(args.kernels)
        result = bench_kernels.bench_mxfp4(args.device, args.dtype, tokens=args.batch, repeats=args.repeats)
        result["spine"] = bench_kernels.bench_spine(args.device, args.dtype, repeats=args.repeats)
        result["probe"] = bench_kernels.probe_against_kernels(args.device, args.dtype, result, result["spine"])
    elif args.model:
        result = _bench_model(args)
    else:
        raise DeltafinError("deltafin bench needs --model DIR, --disk PATH or --kernel")
    print(json.dumps(result, indent=2))
    return 0


def _bench_model(args: argparse.Namespace) -> dict:
    """`deltafin bench --model`: decode, or with --verify / --second-turn / --prefill, that benchmark."""
    from deltafin.cli import bench  # torch: loaded when the command runs

    if args.tokens is not None and args.tokens < 1:
        raise DeltafinError(f"--tokens must be at least 1, got {args.tokens}")
    lengths = _positive_ints(args.prefill, "--prefill") if args.prefill else None
    if lengths:  # the stage is sized for the longest prompt
        args.context = max(args.context or 0, *lengths)
    if args.quality:  # before the stage's options: --expert-mode may say all
        return _bench_quality(args)
    options = stage_within_memory(args)
    common = {"device": args.device, "dtype": args.dtype, "options": options}
    if args.workload:
        from deltafin.cli.workload import (
            bench_workload,  # torch: loaded when the command runs
        )

        args.cache_share = 0.25 if args.cache_share is None else _share(args.cache_share)
        return bench_workload(args.model, [w.strip() for w in args.workload.split(",") if w.strip()], args.tokens or 16,
                              device=args.device, cache_share=args.cache_share,
                              options=options if args.expert_cache_gb is not None else None, pass_cost=args.pass_cost,
                              expert_mode=options.expert_mode)
    if args.verify:  # planned as a speculating stage: room for the verification's KDA trail
        from deltafin.plan.memory.sizing_options import SPECULATIVE_TOKENS  # loaded when the command runs

        common["options"] = options.replace(speculative_tokens=SPECULATIVE_TOKENS)
        return bench.bench_verify(args.model, _positive_ints(args.verify, "--verify"), prompt=args.prompt, **common)
    if args.second_turn:
        prompt, new = _positive_ints(args.second_turn, "--second-turn")[:2] if args.second_turn.count(",") == 1 \
            else (0, 0)
        if not prompt:
            raise DeltafinError(f"--second-turn takes PROMPT,NEW token counts, got {args.second_turn!r}")
        return bench.bench_second_turn(args.model, prompt, new, **common)
    if lengths:
        return bench.bench_prefill(args.model, lengths, measure_disk=not args.no_disk, **common)
    decode = bench.bench_heat if args.heat else bench.bench_decode  # --heat: decode without and with the heat
    return decode(args.model, tokens=args.tokens or 16, prompt=args.prompt, measure_disk=not args.no_disk, **common)


def _bench_quality(args: argparse.Namespace) -> dict:
    """`bench --quality`: --spine (int8 when left auto) against the spine as stored; or --wire against one
    process; or --expert-mode (a mode, or all; with --spine, the modes' spine) against exact."""
    from deltafin.cli import bench_quality  # torch: loaded when the command runs

    modes, share = None, {} if args.cache_share is None else {"cache_share": _share(args.cache_share)}
    if args.expert_mode.strip().lower() != EXACT:
        from deltafin.cli.bench_modes import modes_asked  # (the same)

        modes = modes_asked(args.expert_mode)  # a bad mode is refused before the text is read
    sequences = bench_quality.sequences_for(args.model, args.text)
    if modes is not None:
        from deltafin.cli.bench_modes import mode_quality  # (the same)

        modes_spine = {} if args.spine == "auto" else {"spine": args.spine}  # the modes' (exact's: as stored)
        return mode_quality(args.model, modes, sequences, device=args.device, tokens=args.tokens,
                            policy=args.cache_policy, **share, **modes_spine)
    if args.wire != "fp32":
        return bench_quality.wire_quality(args.model, args.wire, sequences, device=args.device, tokens=args.tokens)
    spine = converted_spines()[-1] if args.spine == "auto" else args.spine  # auto: the most bytes converted (int8)
    return bench_quality.spine_quality(args.model, spine, sequences, device=args.device, tokens=args.tokens)


def _share(value: float) -> float:
    if not 0 < value <= 1:
        raise DeltafinError(f"--cache-share must be in (0, 1], got {value}")
    return value


def _positive_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise DeltafinError(f"{flag} takes comma-separated positive integers, got {text!r}")
    return values


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that print JSON",
                       description="--model DIR: decode speed, sized to the memory found (or --memory-gb): the JSON "
                       "has the memory plan and the peak, bytes per token (experts, spine), and when anything streams "
                       "the disk measured first with the same reader, the limit terms (t_io_limit, t_compute) and "
                       "efficiency = max(t_io_limit, t_compute) / s_per_token. --disk PATH: the reader alone. "
                       "--kernel: MXFP4 expert throughput (packed GB/s) and K3's big spine matrices as bf16, int8 and "
                       "q4 at decode and prefill (ms, weight GB/s). --model DIR --prefill LENGTHS: prefill "
                       "tok/s by prompt length; --second-turn PROMPT,NEW: what the prefix cache saves; --verify KS: "
                       "what a speculative verification pass of k drafts costs; --workload chat,code: routing, cache, "
                       "prefetch and drafting on a trained model's own answers; --quality: what a spine format "
                       "costs against the spine as stored, or with --expert-mode MODE (or all: every registered "
                       "mode) what an expert mode costs and saves against exact.")
    p.add_argument("--model", type=model_arg, help=MODEL_HELP + ": measure decode")
    p.add_argument("--disk", help="a directory or large file: measure the disk with the expert reader")
    p.add_argument("--kernel", action="store_true", help="measure the MXFP4 expert kernel and the spine matmul in each "
                   "spine format at K3's width, and beside them what a worker's compute probe measures (`probe`: "
                   "the plan prices with it; its ratios to the kernels' figures)")
    _add_model_benchmarks(p)
    p.add_argument("--tokens", type=int, default=None, help="decode steps to time (default 16); --workload: the "
                   "most tokens of each answer (default 16); --quality: the most positions measured (default: all)")
    p.add_argument("--prompt", type=int, default=4, help="prompt tokens prefilled first (default 4)")
    p.add_argument("--batch", type=int, default=1, help="--kernel: tokens per matmul (default 1)")
    p.add_argument("--repeats", type=int, default=20, help="--kernel: timed repeats (default 20)")
    add_device_options(p)
    p.add_argument("--no-disk", action="store_true", help="--model: skip the disk measurement")
    add_stage_options(p, sequences=1)
    p.set_defaults(func=_cmd_bench)


def _add_model_benchmarks(p: argparse.ArgumentParser) -> None:
    """`bench --model`'s other measurements than decode."""
    p.add_argument("--prefill", metavar="LENGTHS", help="--model: time prefill of prompts of these lengths instead "
                   "(comma-separated, e.g. 1024,4096,16384), in chunks of --prefill-chunk; --context becomes at "
                   "least the longest")
    p.add_argument("--verify", metavar="KS", help="--model: one speculative verification pass (the last token "
                   "and k drafts in one forward) for each k (comma-separated, e.g. 1,2,3,4,5,6,7,8): seconds, "
                   "expert and spine GB read")
    p.add_argument("--second-turn", metavar="PROMPT,NEW", help="--model: a chat's second turn (a PROMPT-token "
                   "first request, 4 generated tokens, NEW more tokens): its time to first token with the prefix "
                   "cache and without")
    p.add_argument("--workload", metavar="NAMES", help="--model: chat and/or code (comma-separated): answer a fixed "
                   "set of such prompts greedily, plainly, with n-gram drafts and with the model's draft head "
                   "(acceptance, forwards and expert bytes per token), and replay the answers through a streaming "
                   "stage (each cache policy's hit rate on that routing trace, prefetch recall)")
    p.add_argument("--quality", action="store_true", help="--model: what --spine (default int8) costs against the "
                   "spine as stored (bf16): perplexity of both, mean KL divergence of the next-token distribution and "
                   "top-1 agreement, over k3-mini's held-out split (its recipe's checkpoints) or --text FILE; with "
                   "--expert-mode MODE|all, each mode against exact, with its expert reads a token beside exact's (and "
                   "with --spine, the modes' spine in that format: what both together cost)")
    p.add_argument("--text", metavar="FILE", help="--quality: the text to measure on (cut into 2048-token "
                   "sequences)")
    p.add_argument("--wire", choices=WIRES, default="fp32", help="--quality: with bf16, what that wire costs instead "
                   "of a spine format: two wide stages whose hop and expert calls round what crosses the links as "
                   "--wire bf16 does, against one process (default fp32: the spine's cost)")
    p.add_argument("--heat", action="store_true", help="--model: the expert cache's hit rate without and with the "
                   "experts' remembered heat (hit_rate_cold, hit_rate_warm): decode twice, each in a fresh pipeline, "
                   "the first with no heat (a folder of its own: yours is neither used nor changed), the second warmed "
                   "from the heat the first saved, on other seeded tokens")
    p.add_argument("--cache-share", type=float, default=None, help="--workload: the expert cache of the answers "
                   "and of the replay, as a share of all experts (default 0.25; --expert-cache-gb sets it in GB "
                   "instead); --quality --expert-mode: the cache a mode's reads are replayed through and a "
                   "cache-aware mode holds (default 0.008: one 64 GB Mac's share of K3's experts)")
    p.add_argument("--pass-cost", choices=("reads", "timed"), default="reads", help="--workload: how the drafting "
                   "modes price a verification pass when they choose how many drafts to send: reads (default: by the "
                   "experts it reads alone, as on one 64 GB Mac streaming K3's experts with its spine resident, the "
                   "plan the bench's cache stands for) or timed (as the engine here does: the plan corrected by this "
                   "machine's timed passes)")
