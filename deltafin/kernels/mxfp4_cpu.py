"""The CPU fast path for MXFP4 matmuls: a small C kernel (mxfp4_cpu.c), built at first use with the
system compiler, called through ctypes (which releases the GIL) on row blocks in parallel threads.

Plain torch decodes MXFP4 at ~0.07 GB/s of packed bytes on two cores (PERF.md); this kernel runs at
several GB/s, so the CPU no longer bounds expert streaming. If no compiler is found, or the build fails,
or the self-check against the torch reference fails, the reference path is used with a warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from deltafin.quant import MXFP4Weight

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("mxfp4_cpu.c")
_PARALLEL_MIN_WEIGHTS = 1 << 18  # below this, one thread: dispatch would cost more than it saves
_BLAS_MIN_TOKENS = 40  # from here on, decoding W once and multiplying with BLAS is faster (measured, AVX2)


def cache_dir() -> Path:
    return Path(os.environ.get("DELTAFIN_CACHE", Path.home() / ".cache" / "deltafin")) / "kernels"


def _compile(out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    errors = []
    for arch in (["-march=native"], ["-mcpu=native"], []):
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            target = Path(tmp) / out.name
            cmd = [cc, "-O3", *arch, "-shared", "-fPIC", "-o", str(target), str(SOURCE), "-lm"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode == 0:
                os.replace(target, out)  # atomic: concurrent builders never see a partial library
                return
            errors.append(f"{' '.join(cmd)}: {r.stderr.strip()[:500]}")
    raise RuntimeError("compiling the MXFP4 CPU kernel failed:\n" + "\n".join(errors))


def load_library() -> ctypes.CDLL:
    digest = hashlib.sha256(SOURCE.read_bytes() + platform.machine().encode()).hexdigest()[:16]
    path = cache_dir() / f"mxfp4_cpu-{digest}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        _compile(path)
    lib = ctypes.CDLL(str(path))
    lib.deltafin_mxfp4_matmul.restype = None
    lib.deltafin_mxfp4_matmul.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_void_p]
    lib.deltafin_mxfp4_decode.restype = None
    lib.deltafin_mxfp4_decode.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4
    lib.deltafin_mxfp4_isa.restype = ctypes.c_int
    return lib


class CPUMatmul:
    """y = x @ W.T for MXFP4 W on the CPU, rows split over `threads` worker threads."""

    ISA = {1: "portable C", 2: "AVX2+FMA", 3: "NEON"}

    def __init__(self, lib: ctypes.CDLL, threads: int | None = None):
        self.lib = lib
        self.threads = max(1, threads or torch.get_num_threads())
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="deltafin-mxfp4")
        self.isa = self.ISA.get(lib.deltafin_mxfp4_isa(), "?")

    def _split(self, rows: int, cols: int) -> list[int]:
        n = self.threads if rows * cols >= _PARALLEL_MIN_WEIGHTS else 1
        return [rows * i // n for i in range(n + 1)]

    def _run(self, fn: ctypes._CFuncPtr, bounds: list[int], args: tuple, extra: list[tuple]) -> None:
        if len(bounds) == 2:
            fn(*args, bounds[0], bounds[1], *extra[0])
            return
        jobs = [self.pool.submit(fn, *args, bounds[i], bounds[i + 1], *extra[i]) for i in range(len(bounds) - 1)]
        for j in jobs:
            j.result()

    def decode(self, w: MXFP4Weight) -> torch.Tensor:
        """W as a dense fp32 [rows, cols] matrix."""
        rows, cols = w.shape
        packed, scales = w.packed.contiguous(), w.scales.contiguous()
        out = torch.empty(rows, cols, dtype=torch.float32)
        bounds = self._split(rows, cols)
        args = (packed.data_ptr(), scales.data_ptr(), out.data_ptr(), rows, cols)
        self._run(self.lib.deltafin_mxfp4_decode, bounds, args, [()] * (len(bounds) - 1))
        return out

    def __call__(self, x: torch.Tensor, w: MXFP4Weight) -> torch.Tensor:
        rows, cols = w.shape
        lead = x.shape[:-1]
        xf = x.reshape(-1, cols).to(torch.float32).contiguous()
        ntok = xf.shape[0]
        if ntok >= _BLAS_MIN_TOKENS:
            return torch.nn.functional.linear(xf, self.decode(w)).view(*lead, rows).to(x.dtype)
        packed, scales = w.packed.contiguous(), w.scales.contiguous()
        y = torch.empty(ntok, rows, dtype=torch.float32)
        bounds = self._split(rows, cols)
        scratch = torch.empty(len(bounds) - 1, cols, dtype=torch.float32)  # one decoded row per thread
        args = (packed.data_ptr(), scales.data_ptr(), xf.data_ptr(), y.data_ptr(), rows, cols, ntok)
        self._run(self.lib.deltafin_mxfp4_matmul, bounds, args, [(row.data_ptr(),) for row in scratch])
        return y.view(*lead, rows).to(x.dtype)
