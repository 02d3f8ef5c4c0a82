"""Regenerate the llama.cpp golden logits for Kimi K3 (not run by CI; its output is committed).

    python -m tests.reference.golden.make_llamacpp_golden --llama-src DIR \
        [--out tests/reference/golden/k3_tiny_llamacpp.npz]

DIR is the unpacked PyPI sdist of llama-cpp-python==0.3.36
(`pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`), and the same version must be
importable (`pip install llama-cpp-python==0.3.36` builds it from that sdist).

What it does:
1. `deltafin synth --preset tiny --seed 0` (the checkpoint the CI test rebuilds; its sha256 is recorded).
2. An "exact twin" of it: the same checkpoint with every MXFP4 expert dequantized to f32 (`w*.weight`)
   and no quantization_config. MXFP4 values are exact in f32, so the twin computes the same function.
3. Converts both with llama.cpp's vendored `convert_hf_to_gguf.py --outtype f32` (the MXFP4 one keeps
   its experts MXFP4). No tokenizer is converted (`tokenizer.ggml.model = none`): we evaluate ids.
4. Evaluates the fixed id sequence on llama.cpp's CPU backend with f32 caches, flash attention off,
   and records logits at every position, plus a greedy continuation from the exact twin.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import runpy
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from deltafin.kernels.quant import MXFP4Weight, dequantize_mxfp4
from deltafin.mini.synth import synthesize

IDS = [5, 100, 300, 7, 9, 700, 12, 44, 3, 1000, 2, 17, 768, 250, 33, 512, 64, 129, 900, 8]
GREEDY_STEPS = 12


def checkpoint_digest(d: Path) -> str:
    """sha256 over the files that define the model (tokenizer caches written later do not count)."""
    h = hashlib.sha256()
    for p in sorted(d.iterdir()):
        if p.suffix == ".safetensors" or p.name in ("config.json", "model.safetensors.index.json"):
            h.update(p.name.encode())
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def exact_twin(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["text_config"]["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(src / shard)
        out = {}
        for name, t in tensors.items():
            if name.endswith(".weight_scale"):
                continue
            if name.endswith(".weight_packed"):
                scales = tensors[name.removesuffix("_packed") + "_scale"]
                out[name.removesuffix("_packed")] = dequantize_mxfp4(MXFP4Weight(t, scales), torch.float32)
            else:
                out[name] = t
        save_file(out, dst / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in out})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def convert(llama_dir: Path, model: Path, out: Path) -> None:
    sys.path.insert(0, str(llama_dir))
    sys.path.insert(1, str(llama_dir / "gguf-py"))
    from conversion.kimi_k3 import KimiK3Model  # the vendored converter

    KimiK3Model.set_vocab = lambda self: self._set_vocab_none()  # ids in, logits out: no tokenizer needed
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(model), "--outtype", "f32", "--outfile", str(out)]
    try:
        runpy.run_path(str(llama_dir / "convert_hf_to_gguf.py"), run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
    finally:
        sys.argv = argv


def evaluate(gguf: Path, ids: list[int], greedy_steps: int, one_by_one: bool = False) -> tuple[np.ndarray, list[int]]:
    """Logits at every position of `ids` (one batch, or one token per call), then a greedy continuation."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), n_ctx=128, n_batch=128, n_ubatch=128, n_threads=2, logits_all=True,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False,
                          verbose=False)
    if one_by_one:
        for t in ids:
            llm.eval([t])
    else:
        llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
    greedy = []
    for _ in range(greedy_steps):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(nxt)
        llm.eval([nxt])
    return logits, greedy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-src", type=Path, required=True, help="unpacked llama-cpp-python-0.3.36 sdist")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "k3_tiny_llamacpp.npz")
    args = ap.parse_args()
    import llama_cpp

    assert llama_cpp.__version__ == "0.3.36", llama_cpp.__version__
    llama_dir = args.llama_src / "vendor" / "llama.cpp"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = synthesize("tiny", tmp / "tiny", seed=0, show_progress=False)
        exact_twin(ckpt, tmp / "twin")
        convert(llama_dir, ckpt, tmp / "mxfp4.gguf")
        convert(llama_dir, tmp / "twin", tmp / "exact.gguf")
        exact, greedy = evaluate(tmp / "exact.gguf", IDS, GREEDY_STEPS)
        exact_decode, _ = evaluate(tmp / "exact.gguf", IDS, 0, one_by_one=True)
        mxfp4, greedy_mxfp4 = evaluate(tmp / "mxfp4.gguf", IDS, GREEDY_STEPS)
        np.savez_compressed(args.out, ids=np.array(IDS), logits_exact=exact, logits_exact_decode=exact_decode,
                            logits_mxfp4=mxfp4,
                            greedy_exact=np.array(greedy), greedy_mxfp4=np.array(greedy_mxfp4),
                            checkpoint_sha256=np.array(checkpoint_digest(ckpt)),
                            producer=np.array(f"llama-cpp-python {llama_cpp.__version__}, CPU, f32 KV, "
                                              "convert_hf_to_gguf.py --outtype f32"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
