"""k3-mini's whole recipe, one step at a time (tools/k3_mini.py is its command line).

  prepare   the corpus from this Python's standard library (corpus.py), the BPE vocabulary trained on it
            (bpe.py), and the training stream: every training conversation in K3's chat format and every
            source piece as plain text, shuffled, each ended by [EOS], as uint16 token ids (`train.npy`)
  train     `synth --preset mini` (seeded) as the starting point, trained (train.py) and exported in the
            K3 layout with MXFP4 experts (export.py), the vocabulary copied in
  draft     the EAGLE-3 draft head: the trained model's own answers to training prompts, its features on them
            (draft_data.py), the head trained on them (draft.py), measured (its acceptance on the bench's
            prompts, its calibration on other training prompts) and written beside the model (eagle_export.py)
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
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from deltafin.checkpoint.config import load_config, parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.mini import bpe, corpus, draft, draft_data, eagle_export
from deltafin.mini.draft import DraftTrainConfig
from deltafin.mini.export import export
from deltafin.mini.synth import synthesize
from deltafin.mini.train import TrainConfig, load_parameters, train
from deltafin.models.eagle import EagleHead
from deltafin.plan.memory.sizing_options import SPECULATIVE_TOKENS
from deltafin.text import vocab
from deltafin.text.tokenizer import K3Tokenizer
from deltafin.weights.draft_head import load_eagle

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


def train_draft(data: Path, model_dir: Path, out: Path, tc: DraftTrainConfig, exclude: set[str],
                measure: dict[str, tuple[str, ...]]) -> dict:
    """Train k3-mini's draft head from `data` (prepare's output; the target's answers and features are cached
    in `data`/draft) and write it to `out`; `exclude`: prompts never trained on; `measure`: named prompt sets
    whose greedy answers the head is measured on (speculative decoding, k = 1..6). Returns the provenance."""
    t0 = time.perf_counter()
    cache = data / "draft"
    cache.mkdir(parents=True, exist_ok=True)
    aux = "-".join(map(str, tc.aux_layers))
    train_name = f"train-{tc.prompts}-{tc.max_tokens}-s{tc.seed}"
    answered = _cached_answers(cache / f"{train_name}.answers.jsonl", model_dir, tc.max_tokens,
                               lambda: draft_data.training_prompts(data, tc.prompts, tc.seed, exclude))
    feats = _cached_features(cache / f"{train_name}-aux{aux}.features.pt", model_dir, answered, tc.aux_layers)
    cfg_target = load_config(model_dir)
    target = load_parameters(cfg_target, model_dir, torch.device("cpu"))
    hcfg = draft.head_config(tc, cfg_target.hidden_size, cfg_target.num_heads, cfg_target.vocab_size,
                             cfg_target.rms_norm_eps)
    to_target = draft.draft_vocabulary(feats, tc.draft_vocab, cfg_target.vocab_size)
    to_draft = torch.full((cfg_target.vocab_size,), -1, dtype=torch.long)
    to_draft[to_target] = torch.arange(len(to_target))
    w = draft.init_weights(hcfg, target["model.embed_tokens.weight"], target["lm_head.weight"],
                           target["model.norm.weight"], to_target, tc.seed)
    w, history = draft.train_head(hcfg, w, feats, to_draft, tc)
    tmp_out = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp_out, ignore_errors=True)
    eagle_export.write_head(tmp_out, hcfg, w, {})
    shipped = load_eagle(tmp_out, model_dir, "cpu")  # as shipped (bf16)
    table = _measure(shipped, cache, model_dir, tc, measure)
    calibration = _calibration(shipped, data, model_dir, tc, exclude)
    trained = {"recipe": "python tools/k3_mini.py draft --data DATA (deltafin/mini/draft.py)",
               "target": "deltafin/assets/k3-mini", "train": {**asdict(tc), "aux_layers": list(tc.aux_layers)},
               "data": {"prompts": len(answered), "answer_tokens": sum(len(a.ids) - a.start for a in answered),
                        "positions": int(feats.ids.numel()), "excluded_prompts": len(exclude)},
               "final_loss": history[-1]["loss"], "final_accuracy": history[-1]["accuracy"],
               "seconds": round(time.perf_counter() - t0), "device": "cpu",
               "offline_acceptance": table, "calibration": calibration}
    eagle_export.write_head(tmp_out, hcfg, w, trained)
    shutil.rmtree(out, ignore_errors=True)
    tmp_out.rename(out)
    return trained


def _measure(head: EagleHead, cache: Path, model_dir: Path, tc: DraftTrainConfig,
             measure: dict[str, tuple[str, ...]]) -> dict[str, dict]:
    """The head's acceptance table on each named prompt set's greedy answers (cached like the training data)."""
    aux, table = "-".join(map(str, tc.aux_layers)), {}
    for name, prompts in measure.items():
        ans = _cached_answers(cache / f"measure-{name}-{tc.max_tokens}.answers.jsonl", model_dir, tc.max_tokens,
                              lambda prompts=prompts: list(prompts))
        table[name] = draft.acceptance_table(head, _cached_features(
            cache / f"measure-{name}-{tc.max_tokens}-aux{aux}.features.pt", model_dir, ans, tc.aux_layers))
    return table


def _calibration(head: EagleHead, data: Path, model_dir: Path, tc: DraftTrainConfig, exclude: set[str]
                 ) -> list[dict[str, float]]:
    """How often the head's drafts are taken by their confidence (draft.calibration, chains of the most drafts a
    pass verifies), on the target's answers to `tc.calibration_prompts` training questions the head was not
    trained on, nor the bench: what an engine starts from (text/drafting.py's `Calibration.shipped`)."""
    trained_on = set(draft_data.training_prompts(data, tc.prompts, tc.seed, exclude))
    name = f"calibrate-{tc.calibration_prompts}-{tc.max_tokens}-s{tc.seed}-after{tc.prompts}"
    answered = _cached_answers(data / "draft" / f"{name}.answers.jsonl", model_dir, tc.max_tokens,
                               lambda: draft_data.training_prompts(data, tc.calibration_prompts, tc.seed + 1,
                                                                   exclude | trained_on))
    aux = "-".join(map(str, tc.aux_layers))
    feats = _cached_features(data / "draft" / f"{name}-aux{aux}.features.pt", model_dir, answered, tc.aux_layers)
    return draft.calibration(head, feats, SPECULATIVE_TOKENS - 1).describe()


def _cached_answers(path: Path, model_dir: Path, max_tokens: int, prompts: Callable[[], list[str]]
                    ) -> list[draft_data.Answered]:
    if not path.is_file():
        draft_data.save_answers(path, draft_data.answer(model_dir, prompts(), max_tokens))
    return draft_data.load_answers(path)


def _cached_features(path: Path, model_dir: Path, answered: list[draft_data.Answered],
                     aux: tuple[int, ...]) -> draft_data.Features:
    if not path.is_file():
        draft_data.save_features(path, draft_data.target_features(model_dir, answered, aux))
    return draft_data.load_features(path)
