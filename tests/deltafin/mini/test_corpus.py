"""The corpus: entries from a small library tree (and two real stdlib files), conversations, the held-out
split by module, and the K3 chat text and tokens of a conversation."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deltafin.mini import corpus
from deltafin.text import chat, vocab
from deltafin.text.tokenizer import K3Tokenizer

FILES = {
    "pkg/__init__.py": '"""A package for testing the corpus walk."""\n',
    "pkg/shapes.py": '''"""Shapes and their areas, for the corpus tests."""

import math


class Circle:
    """A circle of a given radius, centred at the origin."""

    def __init__(self, radius: float, /, *, name: str = "c") -> None:
        """Make a circle with this radius."""
        self.radius = radius

    def area(self) -> float:
        """The area of the circle: pi times the radius squared."""
        return math.pi * self.radius ** 2

    def _hidden(self):
        """A private helper that the corpus must skip."""


class _Private:
    """A private class, skipped with its methods."""

    def visible(self):
        """Public name, but its class is private."""


def scale(shape, factor=2, *args, **kwargs):
    """Scale a shape by a factor. Returns a new shape.

    The old shape is left as it was."""
    return shape


def short():
    """Too short."""


async def fetch(url):
    """Fetch a shape description from somewhere far away."""
''',
    "mod.py": '"""' + "A long module docstring.\n\n" + "word " * 150 + "\n\n" + "more " * 150 + '"""\n\n'
              + "def long_source():\n    '''A function whose source is too long to keep.'''\n"
              + "    x = 1\n" * 300,
    "_private.py": '"""A private module that the corpus skips."""\n',
    "tests/test_shapes.py": '"""Tests are not documentation for the corpus."""\n',
    "pkg/broken.py": '"""This file does not parse at all."""\ndef (:\n',
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("lib")
    for name, text in FILES.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    stdlib = corpus.stdlib_root()
    for name in ("json/__init__.py", "textwrap.py"):
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(stdlib / name, d / name)
    return d


@pytest.fixture(scope="module")
def found(root: Path) -> dict[str, corpus.Entry]:
    return {e.name: e for e in corpus.entries(root)}


def test_entries_have_kinds_qualnames_and_signatures(found: dict[str, corpus.Entry]) -> None:
    shapes = {n: (e.kind, e.qualname, e.signature) for n, e in found.items() if e.module == "pkg.shapes"}
    assert shapes == {
        "pkg.shapes": ("module", "", ""),
        "pkg.shapes.Circle": ("class", "Circle", "Circle(radius: float, /, *, name: str='c')"),
        "pkg.shapes.Circle.area": ("method", "Circle.area", "area(self) -> float"),
        "pkg.shapes.scale": ("function", "scale", "scale(shape, factor=2, *args, **kwargs)"),
        "pkg.shapes.fetch": ("function", "fetch", "fetch(url)"),
    }
    assert found["pkg"].kind == "module" and found["pkg"].path == "pkg/__init__.py"
    area = found["pkg.shapes.Circle.area"]
    assert area.doc == "The area of the circle: pi times the radius squared."
    assert area.source.startswith("def area(self) -> float:\n    \"\"\"The area")  # dedented out of the class
    scale = "Scale a shape by a factor. Returns a new shape.\n\nThe old shape is left as it was."
    assert found["pkg.shapes.scale"].doc == scale


def test_private_test_short_and_broken_are_skipped(found: dict[str, corpus.Entry]) -> None:
    modules = {e.module for e in found.values()}
    assert modules == {"pkg", "pkg.shapes", "mod", "json", "textwrap"}
    assert not [n for n in found if any(part.startswith("_") for part in n.split("."))]
    assert "pkg.shapes._Private.visible" not in found and "pkg.shapes.Circle._hidden" not in found
    assert "pkg.shapes.short" not in found  # a docstring under MIN_DOC characters


def test_long_docs_are_cut_at_a_paragraph_and_long_sources_dropped(found: dict[str, corpus.Entry]) -> None:
    doc = found["mod"].doc
    assert len(doc) <= corpus.MAX_DOC and doc.endswith("word") and "more" not in doc
    assert found["mod.long_source"].source == ""


def test_real_stdlib_files(found: dict[str, corpus.Entry]) -> None:
    dumps = found["json.dumps"]
    assert dumps.kind == "function" and dumps.signature.startswith("dumps(obj, *, skipkeys=False, ensure_ascii=True")
    assert found["json"].kind == "module" and found["json"].path == "json/__init__.py"
    indent = found["textwrap.indent"]
    assert indent.source.startswith("def indent(text, prefix, predicate=None):") and indent.path == "textwrap.py"
    assert found["textwrap.dedent"].source == ""  # over MAX_SOURCE characters
    assert found["textwrap.TextWrapper.wrap"].kind == "method"


def test_conversations_are_seeded(found: dict[str, corpus.Entry]) -> None:
    items = list(found.values())
    a, b, c = corpus.conversations(items, 0), corpus.conversations(items, 0), corpus.conversations(items, 1)
    assert a == b and a != c
    assert len(items) * 2 <= len(a) <= len(items) * 3
    for conv in a:
        assert [m["role"] for m in conv] == ["user", "assistant"] and conv[1]["reasoning_content"]


def test_answers_follow_the_entry(found: dict[str, corpus.Entry]) -> None:
    convs = corpus.conversations([found["json.dumps"], found["textwrap.indent"]], 0)
    answers = [conv[1]["content"] for conv in convs]
    explain = "`json.dumps(obj, *, skipkeys=False"
    assert any(a.startswith(explain) and "(a function in the `json` module)\n\n" in a for a in answers)
    source = "Here is `textwrap.indent` from `Lib/textwrap.py`:\n\n```python\ndef indent(text, prefix, predicate=None):"
    assert any(a.startswith(source) and a.endswith("\n```") for a in answers)
    method = corpus.conversations([found["pkg.shapes.Circle.area"]], 0)
    assert any(c[1]["content"].startswith("`Circle.area(self) -> float` is a method of `pkg.shapes.Circle`. The area")
               for c in method)
    assert any(c[1]["content"] == "`pkg.shapes.Circle.area(self) -> float`\n\nThe area of the circle: pi times the "
               "radius squared." for c in method)


def test_split_holds_out_whole_modules() -> None:
    pairs = [(f"mod{i}", [{"role": "user", "content": f"q{i}.{j}"}]) for i in range(200) for j in range(3)]
    train, heldout = corpus.split(pairs, heldout_every=10, seed=0)
    assert len(train) + len(heldout) == len(pairs) and heldout
    module = lambda conv: conv[0]["content"][1:].split(".")[0]
    assert not {module(c) for c in train} & {module(c) for c in heldout}
    assert all(corpus.held_out(f"mod{module(c)}", 10) for c in heldout)
    assert corpus.split(pairs, 10, seed=0) == (train, heldout) and corpus.split(pairs, 10, seed=1)[0] != train


def test_jsonl_round_trip(tmp_path: Path, found: dict[str, corpus.Entry]) -> None:
    convs = corpus.conversations(found.values(), 0)
    corpus.write_jsonl(tmp_path / "c.jsonl", convs)
    assert corpus.read_jsonl(tmp_path / "c.jsonl") == convs


CONV = [{"role": "user", "content": "What does `json.dumps` do?"},
        {"role": "assistant", "content": "It serializes.", "reasoning_content": "About json.dumps."}]


def test_render_is_k3_chat_text() -> None:
    plain = corpus.render(CONV, thinking=False)
    assert plain == ('<|open|>message role="user"<|sep|>What does `json.dumps` do?<|close|>message<|sep|><|end_of_msg|>'
                     '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>It serializes.<|close|>response'
                     '<|sep|><|close|>message<|sep|><|end_of_msg|>')
    thinking = corpus.render(CONV, thinking=True)
    assert thinking.startswith('<|open|>message role="system" type="thinking-effort"<|sep|>')
    assert "<|open|>think<|sep|>About json.dumps.<|close|>think<|sep|><|open|>response<|sep|>" in thinking


def test_encode_all_thinks_for_most_conversations(tmp_path: Path) -> None:
    vocab.write_tiktoken(tmp_path / "tiktoken.model", vocab.synthetic_ranks(1024, 0))
    vocab.write_tokenizer_config(tmp_path / "tokenizer_config.json", 1024)
    tok = K3Tokenizer.load(tmp_path)
    convs = [[CONV[0], {**CONV[1], "content": f"answer {i}"}] for i in range(200)]
    ids = corpus.encode_all(tok, convs, seed=0)
    assert ids == corpus.encode_all(tok, convs, seed=0)
    think = [tok.decode(x) == corpus.render(c, True) for x, c in zip(ids, convs, strict=True)]
    assert all(t or tok.decode(x) == corpus.render(c, False) for t, x, c in zip(think, ids, convs, strict=True))
    assert 0.7 <= sum(think) / len(think) <= 0.9
    assert ids[0] == chat.encode(tok, convs[0], corpus.chat_options(think[0]))
