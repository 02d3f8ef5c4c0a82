"""Regenerate the gRPC code from proto/deltafin.proto: `python -m deltafin.transport.protoc`.

The output is committed (deltafin/transport/generated/); tests/deltafin/transport/test_protoc.py fails
when it is stale.
Needs grpcio-tools (the `dev` extra).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto" / "deltafin.proto"
OUT = Path(__file__).resolve().parent / "generated"
FILES = ("deltafin_pb2.py", "deltafin_pb2.pyi", "deltafin_pb2_grpc.py")


def generate(out: Path) -> dict[str, str]:
    """Run protoc into `out`; returns {file name: text} with the package-relative import fixed."""
    from grpc_tools import protoc  # grpcio-tools: the dev extra, needed only to regenerate

    args = ["protoc", f"-I{PROTO.parent}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}",
            str(PROTO)]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {PROTO}")
    texts = {name: (out / name).read_text() for name in FILES}
    # protoc writes `import deltafin_pb2`, which only works from the output directory itself
    texts["deltafin_pb2_grpc.py"] = texts["deltafin_pb2_grpc.py"].replace(
        "import deltafin_pb2 as deltafin__pb2", "from . import deltafin_pb2 as deltafin__pb2")
    return texts


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        texts = generate(Path(tmp))
    OUT.mkdir(exist_ok=True)
    doc = '"""Generated from proto/deltafin.proto by `python -m deltafin.transport.protoc`."""\n'
    (OUT / "__init__.py").write_text(doc)
    for name, text in texts.items():
        (OUT / name).write_text(text)
    print(f"wrote {', '.join(FILES)} to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
