"""Where Deltafin keeps what it derives: one rule for every cache (built kernels, derived tokenizers, the
demo's synthetic checkpoint, reference files the tests fetch).

    $DELTAFIN_CACHE, else $XDG_CACHE_HOME/deltafin, else ~/.cache/deltafin

Nothing is ever written into a model directory: it may be read-only or shared (a Hugging Face cache), and a
file beside the checkpoint changes what other tools load from it.
"""

from __future__ import annotations

import os
from pathlib import Path

BUNDLED = "k3-mini"  # the name of the model that ships inside the package


def cache_dir(*parts: str) -> Path:
    """The cache root, or a folder under it (not created)."""
    root = os.environ.get("DELTAFIN_CACHE")
    if root:
        base = Path(root)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deltafin"
    return base.joinpath(*parts)


def bundled_model() -> Path:
    """k3-mini, the small K3 trained on Python's documentation that ships inside the package (deltafin/mini/):
    what `deltafin demo` and the README's examples run."""
    return Path(__file__).resolve().parent / "assets" / "k3-mini"


def models_dir() -> Path:
    """Where models are kept by name: what `deltafin download` writes by default, what `--model NAME` finds."""
    return cache_dir("models")


def known_models() -> list[tuple[str, Path]]:
    """(what `--model` takes to find it, directory) of every model by name: the bundled one first, then those under
    models_dir() (`name_of`)."""
    folder = models_dir()
    kept = sorted(p for p in folder.glob("*") if p.is_dir()) if folder.is_dir() else []
    return [(BUNDLED, bundled_model()), *((name_of(p), p) for p in kept)]


def name_of(kept: Path) -> str:
    """What `--model` takes to find the model at `kept`, a folder of models_dir(): its name, or its whole path where
    its name is the bundled model's (`--model k3-mini` is always the model this Deltafin ships)."""
    return str(kept) if kept.name == BUNDLED else kept.name


def model_path(model: str | Path) -> Path:
    """`resolve_model`, but what names no model stays as given: the command then says what is missing there."""
    try:
        return resolve_model(model)
    except FileNotFoundError:
        return Path(model)


def resolve_model(model: str | Path) -> Path:
    """A model as the user names it: a directory (with a config.json or not: the commands say what is wrong with
    it), the bundled `k3-mini`, or a name under models_dir(). A name that is none of these: FileNotFoundError
    naming what was looked for and where names come from."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    name = str(model)
    if name == BUNDLED:
        return bundled_model()
    if name and "/" not in name and (models_dir() / name).is_dir():
        return models_dir() / name
    if path.exists():
        return path  # a file: the command says it is not a model directory
    known = ", ".join(name for name, _ in known_models())
    raise FileNotFoundError(f"no model {name!r}: not a directory, and no model of that name (known: {known}; "
                            f"`deltafin models` lists them, `deltafin download SOURCE` adds one to {models_dir()})")
