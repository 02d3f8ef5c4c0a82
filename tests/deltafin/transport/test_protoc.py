"""The committed gRPC code is what `python -m deltafin.transport.protoc` makes from proto/."""

from __future__ import annotations

import tempfile
from pathlib import Path


def test_generated_code_is_current():
    from deltafin.transport.protoc import FILES, OUT, generate

    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
    for name in FILES:
        assert (OUT / name).read_text() == fresh[name], f"{name} is stale: run python -m deltafin.transport.protoc"
