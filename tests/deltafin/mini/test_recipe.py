"""The shipped k3-mini (deltafin/assets/k3-mini): the files the recipe made (hashes), in the exact K3 layout,
of K3's architecture, reproducible from this Python's standard library, and answering in Python's words."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform

import pytest

from deltafin.checkpoint.config import ExpertFormat, LayerKind, load_config
from deltafin.checkpoint.shards import scan_checkpoint
from deltafin.mini.draft import DraftTrainConfig
from deltafin.mini.train import TrainConfig
from deltafin.paths import bundled_model
from deltafin.text import vocab
from deltafin.text.drafting import Calibration
from deltafin.text.tokenizer import K3Tokenizer

SHIPPED = {  # sha256 of every file: a changed model must change this table, and the README's measurements
    "config.json": "1e94288b59fb8440378e6eb6d7435e467a02b63e425e6264dee656c92452a974",
    "model-00001-of-00009.safetensors": "9720b7ea55c4508d6b31b0fc31e3908b3acc3bead656efc42c3191d8c523a135",
    "model-00002-of-00009.safetensors": "49c817f91087d1a8a4d6fb3bb7a9af6263635fa27045cf1068fc3b222d92360f",
    "model-00003-of-00009.safetensors": "0129e869844dd0fe0208ded4915ded9629e29dba55e47d0e9fd4f447d691dd3b",
    "model-00004-of-00009.safetensors": "64888c3cd1ce82e98bdbcb8488ce3f5a5bd81d0587e68cf86365c4e3b6b00528",
    "model-00005-of-00009.safetensors": "7da61d4714a61352410ee630abc6f79dfcae643c6aa960228b503aa799294a82",
    "model-00006-of-00009.safetensors": "36d38706f68f126a52cbd63db1c518e90a325827f363ece082c69be73037f6c3",
    "model-00007-of-00009.safetensors": "edf54497fe719e1f35968feec4f18d30fdc25939482866e92b8e4943071d2e1e",
    "model-00008-of-00009.safetensors": "36b0ed4ee2cdbaadd553d9d1544cadfaaa7427d5a47cfe3d96e5ace10b3e46f0",
    "model-00009-of-00009.safetensors": "621b823fa8e966f0b1181c895411493c61d131a432b7e1ff3ab3135ce76d38b0",
    "model.safetensors.index.json": "9b44826de46a71f3f6f308dfee84f69b1c2375dc24262d552a3cf42f40d3478a",
    "tiktoken.model": "1b5b007dadd69e77988954752dc3b55dcfc57361db6fa952ec1fd811a5070111",
    "tokenizer_config.json": "0112c2a25453d664f608ff2a519a4e7529c8544d5dc3250956d58d3aa7a06beb",
    # its draft head (tools/k3_mini.py draft; trained on the CPU, so its bytes are the 2-core VM's arithmetic)
    "draft/config.json": "021a5abe8d8f56f6576a40ab0bf8763bc5db2a220586768309d1be386c8f3373",
    "draft/model.safetensors": "2d042185d1453194a862b2bc07491c5371c8e02db910f792c31de629efcdff75",
}


def test_shipped_files_are_the_recipes_and_fit_the_repository():
    model = bundled_model()
    files = [p for p in model.rglob("*") if p.is_file() and p.name != "README.md"]
    found = {p.relative_to(model).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    assert found == SHIPPED
    head = [p for p in files if p.parent.name == "draft"]
    assert sum(p.stat().st_size for p in files if p not in head) <= 30_000_000
    assert sum(p.stat().st_size for p in head) <= 5_000_000  # the head reads k3-mini's embedding, not a copy


def test_shipped_model_is_k3s_architecture_in_k3s_layout():
    model = bundled_model()
    cfg = load_config(model)
    assert scan_checkpoint(model, cfg).problems == []
    assert {LayerKind.KDA, LayerKind.MLA} <= set(cfg.layer_kinds)
    assert cfg.num_experts >= 32 and cfg.experts_per_token >= 4 and cfg.latent_dim and cfg.latent_norm
    assert cfg.attn_res_block_size > 0 and cfg.expert_format is ExpertFormat.MXFP4 and cfg.first_k_dense == 1
    raw = json.loads((model / "config.json").read_text())
    assert raw["model_type"] == "kimi_k3" and "deltafin_synthetic" not in raw
    assert raw["deltafin_trained"]["start"] == "deltafin synth --preset mini --seed 0"
    assert raw["deltafin_trained"]["train"] == dataclasses.asdict(TrainConfig())  # made with the defaults
    head = json.loads((model / "draft" / "config.json").read_text())["deltafin_trained"]
    defaults = DraftTrainConfig()
    assert head["train"] == {**dataclasses.asdict(defaults), "aux_layers": list(defaults.aux_layers)}
    assert Calibration.shipped(head["calibration"]).acceptance(0.999) > 0.9  # the engine's prior (docs/draft-heads.md)
    tok = K3Tokenizer.load(model)
    n_base = cfg.vocab_size - vocab.N_SPECIAL
    for offset, text in vocab.NAMED_SPECIALS.items():  # K3's specials at K3's offsets from the base vocabulary
        assert tok.encode(text, allow_special=True) == [n_base + offset]


@pytest.mark.skipif(platform.python_version() != "3.11.7", reason="the corpus is this Python's stdlib: the shipped "
                    "vocabulary was made from 3.11.7's")
def test_the_recipe_reproduces_the_shipped_vocabulary_and_data(tmp_path):
    from deltafin.mini.recipe import prepare

    counts = prepare(tmp_path / "data", seed=0)
    trained = json.loads((bundled_model() / "config.json").read_text())["deltafin_trained"]
    assert counts == trained["data"]
    assert (tmp_path / "data" / "tiktoken.model").read_bytes() == (bundled_model() / "tiktoken.model").read_bytes()


def test_it_answers_python_questions_in_pythons_words():
    import deltafin

    with deltafin.load(bundled_model(), device="cpu", progress=False) as m:
        about = m.chat([{"role": "user", "content": "What does `json.dumps` do?"}], max_tokens=48, temperature=0)
        code = m.chat([{"role": "user", "content": "Show me the source of `textwrap.dedent`."}], max_tokens=96,
                      temperature=0)
    # what the training answers look like (corpus.py): a name in backquotes, what it is, its docstring
    assert about.reasoning.startswith("The question is about `") and about.text.startswith("`")
    words = set(about.text.replace("`", " ").replace(".", " ").lower().split())
    assert len(words & {"the", "a", "of", "is", "method", "function", "class", "module", "return", "for"}) >= 3
    assert code.text.startswith("Here is `") and "```python\n" in code.text
