"""A kept state is resumed only by a stage whose numbers are the ones it was computed with: its identity names the
spine format of every layer (and a converted one's recipe), the activation dtype, the device, where the experts
run and the kernels. Switching the spine between restarts on one prefix folder never resumes a state of another
format, and each answer is the one a server without a prefix cache gives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import deltafin
from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import open_checkpoint
from deltafin.kernels import linear
from deltafin.paths import bundled_model
from deltafin.plan.memory.sizing import Placement, SizingInput, size_stage
from deltafin.runtime.stage_build import spine_layout, state_identity
from deltafin.runtime.stage_options import StageOptions

CPU = torch.device("cpu")


def _identity(ckpt, spine: str = "bf16", resident: int | None = None, dtype=torch.float32, backend="torch") -> str:
    cfg = ckpt.config
    sizing = size_stage(cfg, 0, cfg.num_layers, Placement("cpu"), spine, None,
                        cfg.num_layers if resident is None else resident, SizingInput())
    return state_identity(ckpt, 0, cfg.num_layers, CPU, StageOptions(dtype=dtype), sizing, backend)


def test_every_thing_that_changes_a_number_changes_the_identity(tiny_dir, monkeypatch):
    ckpt = open_checkpoint(tiny_dir, load_config(tiny_dir))
    base = _identity(ckpt)
    assert base == _identity(ckpt)  # a restart with the same options finds its folder again
    others = [_identity(ckpt, "int8"), _identity(ckpt, "q4"), _identity(ckpt, dtype=torch.bfloat16),
              _identity(ckpt, backend="mlx")]
    monkeypatch.setattr(linear, "kernel_family", lambda device: "reference")
    monkeypatch.setattr(deltafin.runtime.stage_build, "kernel_family", lambda device: "reference")
    others.append(_identity(ckpt))
    assert len({base, *others}) == 1 + len(others)


def test_the_layout_names_each_layer_s_format(tiny_dir):
    cfg = load_config(tiny_dir)
    whole = size_stage(cfg, 0, 6, Placement("cpu"), "q4", None, 6, SizingInput())
    assert spine_layout(whole) == "q4 0-5"
    assert spine_layout(size_stage(cfg, 0, 6, Placement("cpu"), "bf16", None, 6, SizingInput())) == "stored 0-5"
    streamed = dataclasses.replace(whole, resident_layers=(0, 1), streamed_layers=(2, 3, 4, 5))
    assert spine_layout(streamed) == "q4 0-5"  # streamed layers are read from the converted q4 files


PROMPT = "def read_lines(path):\n    with open(path) as f:\n        return"


def _answer(spine: str, **options) -> tuple[str, int, object]:
    with deltafin.load(bundled_model(), device="cpu", progress=False, spine=spine, **options) as model:
        out = model.generate(PROMPT, max_tokens=12)
        return out.text, out.usage.cached_tokens, model


@pytest.mark.parametrize("order", [("bf16", "q4", "int8", "bf16")])
def test_switching_the_spine_between_restarts_never_resumes_another_format(tmp_path, order):
    """bf16 -> q4 -> int8 -> bf16 on one prefix folder: a new format resumes nothing (0 cached tokens) and
    answers as a run without a prefix cache does; the last bf16 run resumes the first one's kept prompt whole."""
    folder = tmp_path / "prefixes"
    seen: dict[str, int] = {}
    for spine in order:
        want, cached_off, _ = _answer(spine, prefix_cache_gb=0)
        got, cached, _ = _answer(spine, prefix_dir=str(folder))
        assert cached_off == 0 and got == want, spine
        assert cached == seen.get(spine, 0), (spine, cached)
        seen[spine] = cached or _prompt_tokens(PROMPT)
    texts = {s: _answer(s, prefix_cache_gb=0)[0] for s in ("bf16", "q4")}
    assert texts["bf16"] != texts["q4"]  # the formats answer differently: resuming across them would show
    assert len([p for p in folder.iterdir() if p.is_dir()]) == 3  # a folder per identity


def _prompt_tokens(text: str) -> int:
    from deltafin.text.tokenizer import K3Tokenizer

    return len(K3Tokenizer.load(bundled_model()).encode(text))


def test_the_index_and_the_stages_agree_after_a_switch(tmp_path):
    """A prompt kept by a bf16 stage: a q4 stage on the same folder holds none of its ids (HeldPrefixes), and the
    engine's index, told the stages' identities changed, keeps none of its entries."""
    folder = str(tmp_path / "prefixes")
    with deltafin.load(bundled_model(), device="cpu", progress=False, spine="bf16", prefix_dir=folder) as model:
        model.generate(PROMPT, max_tokens=4)
        engine = model.engine
        kept = list(engine.prefixes.entries)
        assert kept
        bf16_identity = engine.backend.prefix_stages[0].identity
    with deltafin.load(bundled_model(), device="cpu", progress=False, spine="q4", prefix_dir=folder) as model:
        engine = model.engine
        assert engine.backend.prefix_stages[0].identity != bf16_identity
        held = model._loop.run(engine.backend.held_prefixes(kept, kept[-1]))
        assert held.lengths == {} and held.logits is None
        model.generate(PROMPT, max_tokens=4)  # kept by the q4 stage now
        index = engine.prefixes
        assert index.entries and all(s.identity == engine.backend.prefix_stages[0].identity for s in index.shares)
        kept = list(index.entries)
        replanned = [dataclasses.replace(s, identity=bf16_identity) for s in index.shares]  # as a re-plan would
        assert sorted(index.reshape(replanned)) == sorted(kept) and not index.entries


def test_an_expert_mode_is_part_of_the_identity(tiny_dir):
    """A kept state computed with top-p experts is never resumed by an exact stage (nor by another mode); exact keeps
    the identity it had before modes existed."""
    ckpt = open_checkpoint(tiny_dir, load_config(tiny_dir))
    cfg = ckpt.config
    sizing = size_stage(cfg, 0, cfg.num_layers, Placement("cpu"), "bf16", None, cfg.num_layers, SizingInput())
    ids = {m: state_identity(ckpt, 0, cfg.num_layers, CPU, StageOptions(expert_mode=m), sizing, "torch")
           for m in ("exact", "top-p:0.7", "top-p:0.70", "cached:0.05")}
    assert ids["exact"] == _identity(ckpt)
    assert ids["top-p:0.7"] == ids["top-p:0.70"]  # one spelling
    assert len({ids["exact"], ids["top-p:0.7"], ids["cached:0.05"]}) == 3
