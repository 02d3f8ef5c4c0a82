"""Prefill speed of llama.cpp (llama-cpp-python 0.3.36) on a GGUF at several prompt lengths, for side-by-side
runs with `deltafin bench --prefill` (not run by CI). Prints JSON.

    python tests/reference/peer/prefill_llamacpp.py MODEL.gguf --lengths 1024,4096,16384 [--threads 2] [--batch 512]

The prompt is the same ids as `deltafin bench --prefill` (i % 700 + 5), evaluated in batches of `--batch`
tokens (llama.cpp's n_batch, like Deltafin's --prefill-chunk), f32 KV cache, CPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import llama_cpp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=512)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    llm = llama_cpp.Llama(args.gguf, n_ctx=max(lengths) + 16, n_batch=args.batch, n_ubatch=args.batch,
                          n_threads=args.threads, n_threads_batch=args.threads, type_k=llama_cpp.GGML_TYPE_F32,
                          type_v=llama_cpp.GGML_TYPE_F32, verbose=False)
    out = {}
    for n in lengths:
        llm.reset()
        ids = [i % 700 + 5 for i in range(n)]
        t0 = time.perf_counter()
        llm.eval(ids)
        seconds = time.perf_counter() - t0
        out[str(n)] = {"seconds": round(seconds, 3), "tok_per_s": round(n / seconds, 1)}
    print(json.dumps({"bench": "prefill", "runtime": f"llama-cpp-python {llama_cpp.__version__}", "model": args.gguf,
                      "threads": args.threads, "batch": args.batch, "lengths": out,
                      "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 3)}, indent=2))


if __name__ == "__main__":
    main()
