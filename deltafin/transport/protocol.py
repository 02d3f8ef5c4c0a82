"""The wire protocol's version and limits (torch-free: the options and discovery read them without loading the
codec). Its history is proto/HISTORY.md, beside the proto; a peer of another version is refused with a line that
says which side to upgrade."""

from __future__ import annotations

PROTOCOL_VERSION = 15  # proto/HISTORY.md's last row
DEFAULT_MAX_MESSAGE = 1 << 30  # gRPC message cap: a long prefill's residual state is hundreds of MB at K3 width


def version_gap(name: str, theirs: int, me: str = "this coordinator") -> str:
    """Why `name`, which speaks protocol `theirs`, cannot be used by `me` (which speaks PROTOCOL_VERSION), and which
    of the two to upgrade: the older one."""
    older = name if theirs < PROTOCOL_VERSION else me
    return (f"{name} speaks protocol {theirs}, {me} {PROTOCOL_VERSION}: upgrade {older} to the other's Deltafin "
            "release (proto/HISTORY.md lists what changed)")
