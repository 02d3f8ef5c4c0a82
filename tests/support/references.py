"""Reference files from other projects, fetched from the package registry (never committed here).

`kimi_k3_template()` is llama.cpp's `models/templates/Kimi-K3.jinja` from the PyPI sdist of
llama-cpp-python 0.3.36 (checked by its sha256), cached under ~/.cache/deltafin/reference.
Set DELTAFIN_K3_TEMPLATE to a local copy to skip the download.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

from deltafin import paths

SDIST = "llama-cpp-python==0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MEMBER = "vendor/llama.cpp/models/templates/Kimi-K3.jinja"


def _cache_dir() -> Path:
    return paths.cache_dir("reference")


def _download_sdist() -> bytes:
    """The sdist from the package index's simple API (PEP 503), checked against the pinned sha256."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    name, version = SDIST.split("==")
    try:
        page = urllib.request.urlopen(f"{index}/{name}/", timeout=60).read().decode()
        links = [u for u in re.findall(r'href="([^"]+)"', page) if f"-{version}.tar.gz" in u]
        if not links:
            raise RuntimeError(f"no sdist of {SDIST} on {index}")
        data = urllib.request.urlopen(urllib.parse.urljoin(f"{index}/{name}/", links[0]), timeout=300).read()
    except OSError as e:
        raise RuntimeError(f"could not download {SDIST} from {index} (set DELTAFIN_K3_TEMPLATE to a copy of "
                           f"{MEMBER}): {e}") from e
    if hashlib.sha256(data).hexdigest() != SDIST_SHA256:
        raise RuntimeError(f"the downloaded {SDIST} sdist does not have the expected sha256")
    return data


def kimi_k3_template() -> str:
    override = os.environ.get("DELTAFIN_K3_TEMPLATE")
    if override:
        return Path(override).read_text()
    cached = _cache_dir() / f"{SDIST_SHA256[:16]}-Kimi-K3.jinja"
    if cached.is_file():
        return cached.read_text()
    data = _download_sdist()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/" + MEMBER))
        text = tar.extractfile(member).read().decode()  # type: ignore[union-attr]
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = cached.with_suffix(".tmp")
    tmp_path.write_text(text)
    tmp_path.replace(cached)
    return text
