"""CPU fast paths: the C kernels of cpu.c (MXFP4, bf16, row-int8, q4 and q3 weights times fp32 activations),
built at first use with the system compiler and called through ctypes, which releases the GIL, on row
blocks in parallel threads.

Plain torch decodes MXFP4 at ~0.07 GB/s of packed bytes on two cores (docs/PERF.md) and multiplies fp32
activations by bf16 weights only after converting the whole matrix; these kernels run at memory speed.
Up to `_KERNEL_MAX_TOKENS` tokens go through the kernels; larger batches decode row blocks and use BLAS.
If no compiler is found, the build fails or the self-check fails, the torch reference path is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from deltafin import paths
from deltafin.kernels.quant import Q4_GROUP, Int8Weight, MXFP4Weight, Q3Weight, Q4Weight, q3_linear_reference

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu.c")
ISA = {1: "portable C", 2: "AVX2+FMA", 3: "NEON", 4: "AVX-512"}
_PARALLEL_MIN_WEIGHTS = 1 << 18  # below this, one thread: dispatch would cost more than it saves
_KERNEL_MAX_TOKENS = 32  # above this, decode row blocks and use BLAS (measured on AVX2/AVX-512)
_BLOCK_ROWS = 2048  # rows decoded at a time on the BLAS path (bounded temporary memory)


def cache_dir() -> Path:
    return paths.cache_dir("kernels")


def _compile(out: Path, archs: list[list[str]]) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    errors = []
    for arch in archs:
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            target = Path(tmp) / out.name
            cmd = [cc, "-O3", *arch, "-shared", "-fPIC", "-o", str(target), str(SOURCE), "-lm"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode == 0:
                os.replace(target, out)  # atomic: concurrent builders never see a partial library
                return
            errors.append(f"{' '.join(cmd)}: {r.stderr.strip()[:500]}")
    raise RuntimeError("compiling the CPU kernels failed:\n" + "\n".join(errors))


def native_archs() -> list[list[str]]:
    """Compiler flags to try, best first, for this machine: Apple clang on Apple silicon takes -mcpu (its
    -march does not know `native`), GCC/clang elsewhere -march=native; plain C (NEON is the arm64 baseline)
    last."""
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return [["-mcpu=native"], ["-mcpu=apple-m1"], []]
    if platform.machine() in ("aarch64", "arm64"):
        return [["-mcpu=native"], ["-march=armv8.4-a"], []]
    return [["-march=native"], []]


def load_library(arch: list[str] | None = None) -> ctypes.CDLL:
    """Build (once, cached) and load the kernels: for this CPU by default, or for `arch` compiler flags."""
    archs = [arch] if arch is not None else native_archs()
    key = SOURCE.read_bytes() + platform.machine().encode() + repr(archs).encode()
    path = cache_dir() / f"cpu-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        _compile(path, archs)
    lib = ctypes.CDLL(str(path))
    p, i = ctypes.c_void_p, ctypes.c_int64
    for name, args in (("deltafin_mxfp4_matmul", [p] * 4 + [i] * 5), ("deltafin_mxfp4_decode", [p] * 3 + [i] * 4),
                       ("deltafin_bf16_matmul", [p] * 3 + [i] * 5), ("deltafin_int8_matmul", [p] * 4 + [i] * 5),
                       ("deltafin_q4_prepare", [p] * 3 + [i] * 2), ("deltafin_q4_matmul", [p] * 6 + [i] * 5),
                       ("deltafin_q4_decode", [p] * 4 + [i] * 4), ("deltafin_q3_matmul", [p] * 6 + [i] * 6)):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, args
    lib.deltafin_isa.restype = ctypes.c_int
    return lib


class CPUKernels:
    """y = x @ W.T on the CPU for MXFP4 (`__call__`), bf16 (`bf16`), row-int8 (`int8`), q4 (`q4`) and q3 (`q3`)
    weights."""

    def __init__(self, lib: ctypes.CDLL, threads: int | None = None):
        self.lib = lib
        self.threads = max(1, threads or torch.get_num_threads())
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="deltafin-cpu")
        self.isa = ISA.get(lib.deltafin_isa(), "?")

    def _rows(self, fn: Callable[..., None], rows: int, cols: int, *args: int) -> None:
        """Run fn(*args, r0, r1) over row blocks, in parallel when the matrix is big enough."""
        n = self.threads if rows * cols >= _PARALLEL_MIN_WEIGHTS else 1
        bounds = [rows * k // n for k in range(n + 1)]
        if n == 1:
            fn(*args, 0, rows)
            return
        jobs = [self.pool.submit(fn, *args, bounds[k], bounds[k + 1]) for k in range(n)]
        for job in jobs:
            job.result()

    @staticmethod
    def _tokens(x: torch.Tensor, cols: int) -> torch.Tensor:
        return x.reshape(-1, cols).to(torch.float32).contiguous()

    def __call__(self, x: torch.Tensor, w: MXFP4Weight) -> torch.Tensor:
        rows, cols = w.shape
        xf = self._tokens(x, cols)
        ntok = xf.shape[0]
        if ntok > _KERNEL_MAX_TOKENS:
            y = F.linear(xf, self.decode(w))
        else:
            packed, scales = w.packed.contiguous(), w.scales.contiguous()
            y = torch.empty(ntok, rows, dtype=torch.float32)
            self._rows(self.lib.deltafin_mxfp4_matmul, rows, cols, packed.data_ptr(), scales.data_ptr(),
                       xf.data_ptr(), y.data_ptr(), rows, cols, ntok)
        return y.view(*x.shape[:-1], rows).to(x.dtype)

    def decode(self, w: MXFP4Weight) -> torch.Tensor:
        """An MXFP4 W as a dense fp32 [rows, cols] matrix."""
        rows, cols = w.shape
        packed, scales = w.packed.contiguous(), w.scales.contiguous()
        out = torch.empty(rows, cols, dtype=torch.float32)
        self._rows(self.lib.deltafin_mxfp4_decode, rows, cols, packed.data_ptr(), scales.data_ptr(),
                   out.data_ptr(), rows, cols)
        return out

    def bf16(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """fp32 activations times a bf16 matrix, exactly (bf16 -> fp32 is a shift), without converting W."""
        rows, cols = w.shape
        xf = self._tokens(x, cols)
        ntok = xf.shape[0]
        if ntok > _KERNEL_MAX_TOKENS:
            y = torch.cat([F.linear(xf, w[r:r + _BLOCK_ROWS].float()) for r in range(0, rows, _BLOCK_ROWS)], dim=1)
        else:
            wc = w.contiguous()
            y = torch.empty(ntok, rows, dtype=torch.float32)
            self._rows(self.lib.deltafin_bf16_matmul, rows, cols, wc.data_ptr(), xf.data_ptr(), y.data_ptr(), rows,
                       cols, ntok)
        return y.view(*x.shape[:-1], rows).to(x.dtype)

    def int8(self, x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
        rows, cols = w.shape
        xf = self._tokens(x, cols)
        ntok = xf.shape[0]
        scale = w.scale.float().reshape(rows).contiguous()
        if ntok > _KERNEL_MAX_TOKENS:
            y = torch.cat([F.linear(xf, w.q[r:r + _BLOCK_ROWS].float()) for r in range(0, rows, _BLOCK_ROWS)],
                          dim=1) * scale
        else:
            q = w.q.contiguous()
            y = torch.empty(ntok, rows, dtype=torch.float32)
            self._rows(self.lib.deltafin_int8_matmul, rows, cols, q.data_ptr(), scale.data_ptr(), xf.data_ptr(),
                       y.data_ptr(), rows, cols, ntok)
        return y.view(*x.shape[:-1], rows).to(x.dtype)

    def q4(self, x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
        """fp32 activations times a q4 matrix (MLX's affine 4-bit groups of 64), without converting W."""
        rows, cols = w.shape
        groups = cols // Q4_GROUP
        if cols % Q4_GROUP or w.scales.shape != (rows, groups) or w.biases.shape != (rows, groups):
            raise ValueError(f"q4 scales {tuple(w.scales.shape)} / biases {tuple(w.biases.shape)} do not match "
                             f"packed {tuple(w.packed.shape)} (one per {Q4_GROUP} values)")
        if w.packed.dtype != torch.uint8 or w.scales.dtype != torch.float16 or w.biases.dtype != torch.float16:
            raise ValueError(f"q4 needs uint8 codes and fp16 scales/biases, got {w.packed.dtype}, {w.scales.dtype}, "
                             f"{w.biases.dtype}")
        xf = self._tokens(x, cols)
        ntok = xf.shape[0]
        prepared = torch.empty(ntok * (cols + groups), dtype=torch.float32)  # permuted x, then group sums
        xp, xsum = prepared[:ntok * cols], prepared[ntok * cols:]
        self.lib.deltafin_q4_prepare(xf.data_ptr(), xp.data_ptr(), xsum.data_ptr(), cols, ntok)
        if ntok > _KERNEL_MAX_TOKENS:  # W decoded in the same permuted, scaled column order as xp
            xm = xp.view(ntok, cols)
            y = torch.cat([F.linear(xm, self.q4_decode(w, r, min(rows, r + _BLOCK_ROWS)))
                           for r in range(0, rows, _BLOCK_ROWS)], dim=1)
        else:
            packed, scales, biases = w.packed.contiguous(), w.scales.contiguous(), w.biases.contiguous()
            y = torch.empty(ntok, rows, dtype=torch.float32)
            self._rows(self.lib.deltafin_q4_matmul, rows, cols, packed.data_ptr(), scales.data_ptr(),
                       biases.data_ptr(), xp.data_ptr(), xsum.data_ptr(), y.data_ptr(), rows, cols, ntok)
        return y.view(*x.shape[:-1], rows).to(x.dtype)

    def q3(self, x: torch.Tensor, w: Q3Weight) -> torch.Tensor:
        """fp32 activations times a q3 matrix (the experts' 3-bit copy), without converting W; more tokens than the
        kernel takes go through the reference (W decoded once, BLAS)."""
        rows, cols = w.shape
        xf = self._tokens(x, cols)
        ntok = xf.shape[0]
        if ntok > _KERNEL_MAX_TOKENS:
            return q3_linear_reference(x.float(), w).to(x.dtype)
        group = w.group
        packed, scales, biases = w.packed.contiguous(), w.scales.contiguous(), w.biases.contiguous()
        xsum = xf.view(ntok, cols // group, group).sum(-1).contiguous()
        y = torch.empty(ntok, rows, dtype=torch.float32)
        self._rows(self.lib.deltafin_q3_matmul, rows, cols, packed.data_ptr(), scales.data_ptr(), biases.data_ptr(),
                   xf.data_ptr(), xsum.data_ptr(), y.data_ptr(), rows, cols, group, ntok)
        return y.view(*x.shape[:-1], rows).to(x.dtype)

    def q4_decode(self, w: Q4Weight, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of a q4 W as a dense fp32 matrix, for BLAS: in the column order of and scaled inversely
        to deltafin_q4_prepare's x (cpu.c), so that F.linear(prepared x, this) = x @ W.T."""
        cols = w.shape[1]
        packed, scales, biases = (t[r0:r1].contiguous() for t in (w.packed, w.scales, w.biases))
        out = torch.empty(r1 - r0, cols, dtype=torch.float32)
        self._rows(self.lib.deltafin_q4_decode, r1 - r0, cols, packed.data_ptr(), scales.data_ptr(), biases.data_ptr(),
                   out.data_ptr(), r1 - r0, cols)
        return out
