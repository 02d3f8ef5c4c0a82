"""The draft head's data: k3-mini's own greedy answers to chat prompts, and the target's features on them.

A draft head learns to predict what the target will say, so its data is the target's own output, not the
corpus: each prompt (a training conversation's question) is rendered as `deltafin.load(...).chat` renders it
(K3's chat format, thinking effort low) and answered greedily by the runtime (LocalPipeline, fp32, many
prompts a forward), up to `max_tokens` or a stop token (which is kept: the target verifies it too). Then the
whole prompt + answer runs teacher-forced through the model code (models/decoder.py, as training runs it),
taking at each position the hidden states entering the aux layers (`layer_input`, `final_hidden`: the head's
features, as the runtime takes them) and the target's argmax (what a verify pass accepts).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from deltafin.checkpoint.config import ModelConfig, load_config
from deltafin.mini.corpus import read_jsonl
from deltafin.mini.train import as_is, expert_source, layer_tensors, load_parameters
from deltafin.models.cache import new_sequence_cache
from deltafin.models.decoder import Span, attention, embed, feed_forward, final_hidden, head, layer_input
from deltafin.models.moe import route
from deltafin.models.weights import MoEWeights, layer_weights, top_weights
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from deltafin.text import chat
from deltafin.text.tokenizer import K3Tokenizer

log = logging.getLogger(__name__)

STOP_TOKENS = ("<|end_of_msg|>", "[EOS]")  # where K3 stops (the engine's list)
CHAT = chat.ChatOptions(thinking=True, effort="low")  # what Model.chat renders by default


@dataclass(frozen=True)
class Answered:
    """One prompt and the target's greedy answer: ids = prompt + answer, the answer starting at `start`."""

    ids: tuple[int, ...]
    start: int


def training_prompts(data: Path, count: int, seed: int, exclude: set[str]) -> list[str]:
    """`count` distinct user questions of the training conversations (seeded), none of `exclude`."""
    seen = {conv[0]["content"] for conv in read_jsonl(data / "train.jsonl") if conv and conv[0]["role"] == "user"}
    pool = sorted(seen - exclude)
    return random.Random(seed).sample(pool, min(count, len(pool)))


def answer(model_dir: Path, prompts: list[str], max_tokens: int, batch: int = 256) -> list[Answered]:
    """Each prompt's greedy answer through the runtime, `batch` prompts decoding side by side."""
    tok = K3Tokenizer.load(model_dir)
    stops = {tok.specials[t] for t in STOP_TOKENS}
    pipe = LocalPipeline.load(model_dir, 1, device="cpu", dtype="fp32")
    out: list[Answered] = []
    try:
        for at in range(0, len(prompts), batch):
            group = [chat.encode(tok, [{"role": "user", "content": p}], CHAT) for p in prompts[at:at + batch]]
            out += [Answered(tuple(ids + ans), len(ids)) for ids, ans in zip(group, _greedy(pipe, group, max_tokens,
                                                                                           stops), strict=True)]
            log.info("answered %d of %d prompts", len(out), len(prompts))
    finally:
        pipe.close()
    return out


def _greedy(pipe: LocalPipeline, prompts: list[list[int]], max_tokens: int, stops: set[int]) -> list[list[int]]:
    names = [f"draft-data-{i}" for i in range(len(prompts))]
    outs = pipe.forward([SeqInput(n, 0, ids=torch.tensor(p)) for n, p in zip(names, prompts, strict=True)])
    answers = [[int(o.logits[-1].argmax())] for o in outs]
    live = [i for i, a in enumerate(answers) if a[-1] not in stops]
    while live and len(answers[live[0]]) < max_tokens:
        outs = pipe.forward([SeqInput(names[i], len(prompts[i]) + len(answers[i]) - 1,
                                      ids=torch.tensor(answers[i][-1:])) for i in live])
        for i, o in zip(live, outs, strict=True):
            answers[i].append(int(o.logits[-1].argmax()))
        live = [i for i in live if answers[i][-1] not in stops]
    for n in names:
        pipe.release(n)
    return answers


def save_answers(path: Path, answered: list[Answered]) -> None:
    path.write_text("".join(json.dumps({"ids": list(a.ids), "start": a.start}) + "\n" for a in answered))


def load_answers(path: Path) -> list[Answered]:
    return [Answered(tuple(r["ids"]), r["start"]) for r in map(json.loads, path.read_text().splitlines())]


@dataclass(frozen=True)
class Features:
    """Teacher-forced target outputs for sequences of length T_i, packed: row r is one position."""

    ids: torch.Tensor  # [R] int64, the token at each position
    features: torch.Tensor  # [R, F] bf16 (what the head's fc reads; fp32 in serving)
    labels: torch.Tensor  # [R] int64, the target's argmax at each position (its next token)
    offsets: tuple[int, ...]  # sequence i is rows offsets[i]..offsets[i+1]
    starts: tuple[int, ...]  # sequence i's answer starts at its position starts[i]


def target_features(model_dir: Path, answered: list[Answered], aux: tuple[int, ...],
                    batch_tokens: int = 4096) -> Features:
    """Run every sequence teacher-forced through the model code (fp32, no gradient) and take its features."""
    cfg = load_config(model_dir)
    params = load_parameters(cfg, model_dir, torch.device("cpu"))
    feats, labels, group, size = [], [], [], 0
    with torch.no_grad():
        for a in [*answered, None]:
            if a is None or (group and size + len(a.ids) > batch_tokens):
                f, lab = _features(cfg, params, [torch.tensor(g.ids) for g in group], aux)
                feats.append(f.to(torch.bfloat16))
                labels.append(lab)
                group, size = [], 0
            if a is not None:
                group.append(a)
                size += len(a.ids)
    lengths = [len(a.ids) for a in answered]
    offsets = tuple(int(x) for x in torch.tensor([0, *lengths]).cumsum(0))
    return Features(torch.tensor([t for a in answered for t in a.ids]), torch.cat(feats), torch.cat(labels),
                    offsets, tuple(a.start for a in answered))


def _features(cfg: ModelConfig, params: dict[str, torch.Tensor], seqs: list[torch.Tensor],
              aux: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences from empty caches -> (features [R, F] at the aux layers, the target's argmax [R])."""
    ids = torch.cat(seqs)
    top = top_weights(cfg, params, as_is, first=True, last=True)
    state = embed(top, ids, torch.float32)
    spans, at = [], 0
    for s in seqs:
        spans.append(Span(at, len(s), new_sequence_cache(cfg, range(cfg.num_layers), ids.device, torch.float32,
                                                         tokens=len(s))))
        at += len(s)
    taken: dict[int, torch.Tensor] = {}
    for layer in range(cfg.num_layers):
        w = layer_weights(cfg, layer, layer_tensors(params, layer), as_is)
        if layer in aux:
            taken[layer] = layer_input(w, state)
        after, x = attention(cfg, layer, w, state, spans)
        routing = route(cfg, w.ffn, x) if isinstance(w.ffn, MoEWeights) else None
        state = feed_forward(cfg, layer, w, after, x, expert_source(params), routing=routing)
    if cfg.num_layers in aux:
        taken[cfg.num_layers] = final_hidden(top, state)
    return torch.cat([taken[a] for a in aux], dim=-1), head(cfg, top, state).argmax(-1)


def save_features(path: Path, f: Features) -> None:
    torch.save({"ids": f.ids, "features": f.features, "labels": f.labels, "offsets": list(f.offsets),
                "starts": list(f.starts)}, path)


def load_features(path: Path) -> Features:
    d = torch.load(path, weights_only=True)
    return Features(d["ids"], d["features"], d["labels"], tuple(d["offsets"]), tuple(d["starts"]))
