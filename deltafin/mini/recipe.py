"""k3-mini's whole recipe, one step at a time (tools/k3_mini.py is its command line).

  prepare   the corpus from this Python's standard library (corpus.py), the BPE vocabulary trained on it
            (bpe.py), and the training stream: every training conversation in K3's chat format and every
            source piece as plain text, shuffled, each ended by [EOS], as uint16 token ids (`train.npy`)
  train     `synth --preset mini` (seeded) as the starting point, trained (train.py) and exported in the
            K3 layout with MXFP4 experts (export.py), the vocabulary copied in
Everything is seeded: the same Python and seed give the same data and the same starting weights; the
trained weights then depend only on the device's arithmetic.
"""

from __future__ import annotations

import json
import logging
import platform
import random
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from deltafin.checkpoint.config import parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.mini import bpe, corpus
from deltafin.mini.export import export
from deltafin.mini.synth import synthesize
from deltafin.mini.train import TrainConfig, load_parameters, train
from deltafin.text import vocab
from deltafin.text.tokenizer import K3Tokenizer

log = logging.getLogger(__name__)

PRESET = "mini"


def prepare(out: Path, seed: int = 0, root: Path | None = None) -> dict:
    """Write `out`/{train,heldout}.jsonl, tiktoken.model, tokenizer_config.json, train.npy; returns counts."""
    root = root or corpus.stdlib_root()
    out.mkdir(parents=True, exist_ok=True)
    entries = corpus.entries(root)
    train_convs, heldout = corpus.split(corpus.labeled_conversations(entries, seed), seed=seed)
    code = [text for module, text in corpus.source_documents(root) if not corpus.held_out(module)]
    corpus.write_jsonl(out / "train.jsonl", train_convs)
    corpus.write_jsonl(out / "heldout.jsonl", heldout)
    n_base = parse_config(preset_config(PRESET)).vocab_size - vocab.N_SPECIAL
    ranks = bpe.train_ranks([*bpe.training_texts(train_convs), *code], n_base)
    bpe.write_vocab(out, ranks, n_base)
    tok = K3Tokenizer.load(out)
    docs = corpus.encode_all(tok, train_convs, seed) + [tok.encode(text) for text in code]
    random.Random(seed + 1).shuffle(docs)
    eos = vocab.special_tokens(n_base)["[EOS]"]
    stream = np.fromiter((t for d in docs for t in (*d, eos)), dtype=np.uint16)
    np.save(out / "train.npy", stream)
    counts = {"python": platform.python_version(), "entries": len(entries), "train_conversations": len(train_convs),
              "heldout_conversations": len(heldout), "code_pieces": len(code), "train_tokens": int(stream.size)}
    (out / "data.json").write_text(json.dumps(counts, indent=1) + "\n")
    log.info("prepared %s: %s", out, counts)
    return counts


def train_model(data: Path, out: Path, tc: TrainConfig, device: str = "cuda") -> list[dict]:
    """Train from `data` (prepare's output) and write the checkpoint to `out`; returns the training log."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    raw = preset_config(PRESET)
    cfg = parse_config(raw)
    tokens = np.load(data / "train.npy")
    with tempfile.TemporaryDirectory() as tmp:
        start = synthesize(PRESET, Path(tmp) / "start", seed=tc.seed, show_progress=False)
        params = load_parameters(cfg, start, dev)
    history = train(cfg, params, tokens, tc, dev)
    counts = json.loads((data / "data.json").read_text())
    trained = {"recipe": "deltafin/mini (tools/k3_mini.py)", "start": f"deltafin synth --preset {PRESET} "
               f"--seed {tc.seed}", "data": counts, "train": asdict(tc), "device": _device_name(dev),
               "final_loss": history[-1]["loss"]}
    tmp_out = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp_out, ignore_errors=True)
    export(raw, params, vocab.read_tiktoken(data / "tiktoken.model"), tmp_out, trained)
    shutil.rmtree(out, ignore_errors=True)
    tmp_out.rename(out)
    (out.parent / f"{out.name}.train-log.json").write_text(json.dumps(history, indent=1) + "\n")
    return history


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
