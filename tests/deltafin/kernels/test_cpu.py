"""The C kernels: built for every ISA this machine runs, against float64 (q4 also through CPUKernels.q4), the
Mac's NEON build under qemu, the build flags per platform."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from deltafin.kernels import linear as linear_mod
from deltafin.kernels.linear import self_check
from deltafin.kernels.quant import Q4Weight, dequantize_q4


def _isa_builds() -> list[tuple[list[str], str | None]]:
    """The ISAs this machine can run, by its architecture: the portable build, the vector one, the best."""
    import platform

    if platform.machine() in ("aarch64", "arm64"):
        return [(["-O0"], "portable C"), (["-march=armv8.4-a"], "NEON"), (["-mcpu=native"], None)]
    return [(["-O0"], "portable C"), (["-mavx2", "-mfma", "-mf16c"], "AVX2+FMA"), (["-march=native"], None)]


@pytest.mark.parametrize("arch, isa", _isa_builds())
def test_every_cpu_isa_passes_the_self_check(arch, isa, tmp_path, monkeypatch):
    """This machine can run the portable and the vector builds too, so those paths are checked as well."""
    from deltafin.kernels.cpu import CPUKernels, load_library

    monkeypatch.setenv("DELTAFIN_CACHE", str(tmp_path))
    kernels = CPUKernels(load_library(arch), threads=2)
    if isa is not None:
        assert kernels.isa == isa
    assert self_check(kernels, torch.device("cpu"))


def _random_q4(rows: int, cols: int, g: torch.Generator) -> Q4Weight:
    """Every code, scales of both signs from 2^-20 (fp16 subnormals) to 0.1, biases of both signs."""
    scales = torch.rand(rows, cols // 64, generator=g) * 0.1
    scales[torch.rand(scales.shape, generator=g) < 0.1] = 2.0**-20
    scales *= torch.randint(0, 2, scales.shape, generator=g) * 2 - 1
    return Q4Weight(torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g), scales.half(),
                    (torch.randn(rows, cols // 64, generator=g) * 0.5).half())


@pytest.mark.parametrize("arch, isa", _isa_builds())
def test_q4_kernel_matches_a_float64_reference(arch, isa, tmp_path, monkeypatch):
    """CPUKernels.q4 of each ISA build against float64 products of the dequantized weights. Rows not a multiple
    of the 8-row decode block (and split over two threads: 100 x 4160 is above the parallel threshold), 65
    groups a row (more than one 64-group chunk of converted scales, and a tail), token counts 1, 3, 5 (token
    blocks of 4 and their tails) and 33 (above the kernel/BLAS switch), a [2, 3, cols] input."""
    from deltafin.kernels.cpu import CPUKernels, load_library

    monkeypatch.setenv("DELTAFIN_CACHE", str(tmp_path))
    kernels = CPUKernels(load_library(arch), threads=2)
    g = torch.Generator().manual_seed(7)
    for rows, cols, lead in ((13, 192, (1,)), (100, 4160, (1,)), (100, 4160, (3,)), (37, 4160, (5,)),
                             (21, 128, (33,)), (9, 64, (2, 3))):
        w = _random_q4(rows, cols, g)
        x = torch.randn(*lead, cols, generator=g)
        want = torch.nn.functional.linear(x.double(), dequantize_q4(w, torch.float64))
        got = kernels.q4(x, w)
        assert got.shape == want.shape and got.dtype == torch.float32
        # fp32 sums of up to 4160 exact code*x products: ~sqrt(4160) * 2^-24 = 4e-6 relative
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-5, (rows, cols, lead, isa)


def test_q4_kernel_refuses_mismatched_scales(tmp_path, monkeypatch):
    """The C kernel reads cols/64 fp16 scales and biases a row: anything else is refused before it runs."""
    from deltafin.kernels.cpu import CPUKernels, load_library

    monkeypatch.setenv("DELTAFIN_CACHE", str(tmp_path))
    kernels = CPUKernels(load_library(), threads=1)
    w = _random_q4(8, 128, torch.Generator().manual_seed(0))
    x = torch.randn(1, 128)
    with pytest.raises(ValueError, match="do not match"):
        kernels.q4(x, Q4Weight(w.packed, w.scales[:, :1], w.biases))
    with pytest.raises(ValueError, match="fp16"):
        kernels.q4(x, Q4Weight(w.packed, w.scales.float(), w.biases))


NATIVE = Path(__file__).parent / "kernel_check.c"


KERNELS_DIR = Path(linear_mod.__file__).parent


@pytest.mark.parametrize("arch, isa", _isa_builds())
def test_kernels_match_a_float64_reference(arch, isa, tmp_path):
    """The C kernels as a program of their own against float64 (kernel_check.c beside this file), per ISA."""
    exe = tmp_path / "kernel_check"
    subprocess.run(["cc", *arch, "-O2", f"-I{KERNELS_DIR}", str(NATIVE), "-lm", "-o", str(exe)], check=True)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_neon_kernels_under_qemu(tmp_path):
    """The Mac's CPU kernels (NEON, armv8.4-a as on Apple silicon) cross-built with Debian's aarch64 GCC and run
    under qemu-aarch64 against float64 (.ci/run installs gcc-aarch64-linux-gnu and qemu-user)."""
    import shutil

    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cc is None or qemu is None:
        if os.environ.get("DELTAFIN_REQUIRE_NEON"):
            pytest.fail("gcc-aarch64-linux-gnu and qemu-user are missing (.ci/run installs them)")
        pytest.skip("needs gcc-aarch64-linux-gnu and qemu-user (.ci/run installs them)")
    exe = tmp_path / "kernel_check_arm64"
    subprocess.run([cc, "-O2", "-march=armv8.4-a", "-static", f"-I{KERNELS_DIR}", str(NATIVE), "-lm", "-o",
                    str(exe)], check=True)
    r = subprocess.run([qemu, str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("isa 3 "), r.stdout + r.stderr  # 3: NEON


def test_kernel_build_flags_follow_the_platform(monkeypatch):
    """Apple clang on Apple silicon gets -mcpu (its -march has no `native`); Linux arm64 and x86 their own."""
    from deltafin.kernels import cpu

    monkeypatch.setattr(cpu.sys, "platform", "darwin")
    monkeypatch.setattr(cpu.platform, "machine", lambda: "arm64")
    assert cpu.native_archs() == [["-mcpu=native"], ["-mcpu=apple-m1"], []]
    monkeypatch.setattr(cpu.sys, "platform", "linux")
    monkeypatch.setattr(cpu.platform, "machine", lambda: "aarch64")
    assert cpu.native_archs()[1] == ["-march=armv8.4-a"]
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    assert cpu.native_archs() == [["-march=native"], []]
