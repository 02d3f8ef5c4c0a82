"""The tokenizer against tiktoken with the same ranks, regex and specials; streaming detokenization."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from deltafin.cli.commands import main as cli_main
from deltafin.text import vocab
from deltafin.text.tokenizer import K3Tokenizer, StreamDecoder

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "人工智能正在改变我们的世界。今天天气很好，我们去公园散步吧。",
    "日本語のテキスト：こんにちは世界。한국어: 안녕하세요. Русский: привет мир.",
    "def forward(self, x):\n    return self.norm(x) + x  # residual\n\n\n",
    "for (int i = 0; i < n; ++i) {\r\n\tsum += w[i] * x[i];\r\n}",
    "Numbers 3.14159 2.71828 1234567890 163840 2026-11-30 12:34:56 $19.99 100% 1e-6",
    "Emoji 🙂🚀✨ with ZWJ 👩‍👩‍👧‍👦 and flags 🇨🇭🇯🇵 and skin 👍🏽",
    "   leading spaces, trailing spaces   \n\n\n   \t\t  mixed  \u3000 ideographic space",
    "I'm sure they'll say it's what we've got and you'd know THEY'RE RIGHT, O'Neil's.",
    "Français: l'été à Paris. Deutsch: Größe, Übung. Español: año, niño. Ελληνικά: γειά σου.",
    "Combining marks: e\u0301 a\u0308 \u0915\u094d\u0937 \u0645\u0631\u062d\u0628\u0627 and RTL \u202e text",
    "special-looking text <|open|> <|end_of_msg|> [EOS] <|reserved_token_5|> stays text",
    "JSON {\"role\": \"user\", \"content\": \"Hi\\n\", \"n\": [1, 2, 3]}",
    "x" * 500 + " " + "ab" * 300,
    "",
    "\n",
    "\ufffd replacement char and \x00 nul \x7f del",
]


def _tiktoken_for(model_dir: Path) -> tiktoken.Encoding:
    ranks = vocab.read_tiktoken(model_dir / "tiktoken.model")
    specials = vocab.special_tokens(len(ranks))
    return tiktoken.Encoding("k3-test", pat_str=vocab.PRETOKENIZE_REGEX, mergeable_ranks=ranks,
                             special_tokens=specials)


@pytest.fixture(scope="module", params=[("tiny", 0), (4096, 1), (16384, 2)],
                ids=["tiny-vocab", "4k-vocab", "16k-vocab"])
def pair(request, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    preset, seed = request.param
    if preset == "tiny":
        d = tiny_dir
    else:  # a larger vocabulary (more merges, many across UTF-8 character boundaries)
        d = tmp_path_factory.mktemp(f"vocab{preset}")
        vocab.write_tiktoken(d / "tiktoken.model", vocab.synthetic_ranks(preset, seed))
        vocab.write_tokenizer_config(d / "tokenizer_config.json", preset)
    return K3Tokenizer.load(d), _tiktoken_for(d)


def test_encode_matches_tiktoken_on_corpus(pair) -> None:
    ours, ref = pair
    for text in CORPUS:
        assert ours.encode(text) == ref.encode_ordinary(text), text
        assert ours.encode(text, allow_special=True) == ref.encode(text, allowed_special="all"), text
        assert ours.decode(ours.encode(text)) == text


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=80))
def test_encode_matches_tiktoken_on_random_text(pair, text: str) -> None:
    ours, ref = pair
    assert ours.encode(text) == ref.encode_ordinary(text)


def test_lone_surrogates_are_replaced_as_tiktoken_does(pair) -> None:
    ours, ref = pair
    text = "bad \ud800 surrogate \udfff end"
    assert ours.encode(text) == ref.encode_ordinary(text)


def test_decode_of_invalid_utf8_replaces(pair) -> None:
    ours, ref = pair
    byte_ids = [ours.encode(chr(b))[0] if b < 128 else None for b in range(256)]
    assert None in byte_ids  # bytes >= 0x80 alone are not characters; find their single-byte tokens instead
    lone = [t for t in range(ours.vocab_size - vocab.N_SPECIAL) if ours.token_bytes(t) in (b"\xe4", b"\xff")]
    assert lone
    ids = ours.encode("ok ") + lone + ours.encode(" end")
    assert ours.decode(ids) == ref.decode(ids, errors="replace")


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=60))
def test_stream_decoder_never_splits_a_character(pair, text: str) -> None:
    ours, _ = pair
    ids = ours.encode(text)
    decoder = StreamDecoder(ours)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_specials_disabled_by_default(tiny_dir: Path) -> None:
    tok = K3Tokenizer.load(tiny_dir)
    text = "<|open|>message<|sep|>"
    assert tok.specials["<|open|>"] not in tok.encode(text)
    assert tok.encode(text, allow_special=True)[0] == tok.specials["<|open|>"]
    assert tok.decode(tok.encode(text, allow_special=True), skip_special=True) == "message"


def test_the_derived_tokenizer_is_cached_outside_the_model_directory(tiny_dir: Path, tmp_path: Path,
                                                                      monkeypatch) -> None:
    """A model directory may be read-only or shared: nothing is written into it. The derived tokenizer goes
    to the cache directory and is used from there next time (building it again would fail here)."""
    import deltafin.text.tokenizer as tokenizer_module

    d = tmp_path / "m"
    d.mkdir()
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, d / name)
    d.chmod(0o555)
    monkeypatch.setenv("DELTAFIN_CACHE", str(tmp_path / "cache"))
    try:
        first = K3Tokenizer.load(d)
        assert sorted(p.name for p in d.iterdir()) == ["tiktoken.model", "tokenizer_config.json"]
        (cached,) = (tmp_path / "cache" / "tokenizers").iterdir()
        assert cached.suffix == ".json"

        def no_build(*_args):
            raise AssertionError("the cached tokenizer was not used")

        monkeypatch.setattr(tokenizer_module, "build_tokenizer", no_build)
        again = K3Tokenizer.load(d)
        assert again.encode(CORPUS[2]) == first.encode(CORPUS[2])
    finally:
        d.chmod(0o755)


def test_tokenize_and_detokenize_commands(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok = K3Tokenizer.load(tiny_dir)
    assert cli_main(["tokenize", "--model", str(tiny_dir), "Hello 世界"]) == 0
    ids = json.loads(capsys.readouterr().out)
    assert ids == tok.encode("Hello 世界")
    assert cli_main(["detokenize", "--model", str(tiny_dir), json.dumps(ids)]) == 0
    assert capsys.readouterr().out == "Hello 世界\n"
    messages = [{"role": "user", "content": "hi"}]
    assert cli_main(["tokenize", "--model", str(tiny_dir), "--chat", json.dumps(messages)]) == 0
    chat_ids = json.loads(capsys.readouterr().out)
    assert tok.decode(chat_ids).endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert cli_main(["detokenize", "--model", str(tiny_dir), "1,2,x"]) == 1
    assert "error:" in capsys.readouterr().err
    assert cli_main(["tokenize", "--model", str(tiny_dir), "--chat", "{not json"]) == 1
    assert "error:" in capsys.readouterr().err
