"""Decode speed of llama.cpp (llama-cpp-python 0.3.36) on a GGUF, for side-by-side runs with
`deltafin bench` (not run by CI). Prints JSON like `deltafin bench`.

    python tests/reference/peer/bench_llamacpp.py MODEL.gguf [--tokens 12] [--prompt 2]

CPU, mmap, no weight repacking (`--no-repack`), 2 threads; decode steps feed the same seeded random ids
as `deltafin bench` (torch.Generator seed 0), one token per llama_decode. Run it under
`../shared/tools/memlimit 8G --drop-caches --` to cap memory the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import llama_cpp
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    bindings = llama_cpp.llama_cpp  # the ctypes module Llama() takes its default parameters from
    defaults = bindings.llama_model_default_params

    def no_repack():
        p = defaults()
        p.use_extra_bufts = False  # --no-repack: weights used as stored, read through mmap
        return p

    bindings.llama_model_default_params = no_repack
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(args.gguf, n_ctx=64, n_batch=64, n_threads=args.threads, n_threads_batch=args.threads,
                          use_mmap=True, verbose=False)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.eval(list(range(args.prompt)))
    prefill_s = time.perf_counter() - t0
    rng = torch.Generator().manual_seed(0)
    times = []
    for _ in range(args.tokens):
        nxt = int(torch.randint(0, args.vocab - 256, (1,), generator=rng))
        t0 = time.perf_counter()
        llm.eval([nxt])
        times.append(time.perf_counter() - t0)
    print(json.dumps({"bench": "decode", "runtime": f"llama-cpp-python {llama_cpp.__version__}", "model": args.gguf,
                      "threads": args.threads, "load_s": round(load_s, 2), "prefill_s": round(prefill_s, 3),
                      "tokens": args.tokens, "s_per_token_median": round(statistics.median(times), 4),
                      "s_per_token_min": round(min(times), 4), "tok_per_s": round(args.tokens / sum(times), 4)},
                     indent=2))


if __name__ == "__main__":
    main()
