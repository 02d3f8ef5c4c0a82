"""The C kernels: built for every ISA this machine runs, against float64, the Mac's NEON build under qemu,
the build flags per platform."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from deltafin.kernels import linear as linear_mod
from deltafin.kernels.linear import self_check


def _isa_builds() -> list[tuple[list[str], str | None]]:
    """The ISAs this machine can run, by its architecture: the portable build, the vector one, the best."""
    import platform

    if platform.machine() in ("aarch64", "arm64"):
        return [(["-O0"], "portable C"), (["-march=armv8.4-a"], "NEON"), (["-mcpu=native"], None)]
    return [(["-O0"], "portable C"), (["-mavx2", "-mfma"], "AVX2+FMA"), (["-march=native"], None)]


@pytest.mark.parametrize("arch, isa", _isa_builds())
def test_every_cpu_isa_passes_the_self_check(arch, isa, tmp_path, monkeypatch):
    """This machine can run the portable and the vector builds too, so those paths are checked as well."""
    from deltafin.kernels.cpu import CPUKernels, load_library

    monkeypatch.setenv("DELTAFIN_CACHE", str(tmp_path))
    kernels = CPUKernels(load_library(arch), threads=2)
    if isa is not None:
        assert kernels.isa == isa
    assert self_check(kernels, torch.device("cpu"))


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
