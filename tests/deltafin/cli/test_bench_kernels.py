"""`deltafin bench --disk`'s refusal of too little data to measure."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltafin.cli.bench_kernels import bench_disk
from deltafin.errors import DeltafinError


def test_bench_disk_needs_a_gigabyte_of_large_files(tmp_path: Path) -> None:
    (tmp_path / "small.bin").write_bytes(b"\0" * (1 << 20))
    with pytest.raises(DeltafinError, match="need at least 1 GB of files"):
        bench_disk(tmp_path, read_size=4096)
