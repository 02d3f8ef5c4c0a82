"""The package is whole wherever it is installed: the wheel `pip install .` builds holds every package folder and
every file the checkout ships under them (coordinator/ and worker/ as deltafin.coordinator and deltafin.worker), and
an install of it, not the checkout, runs a command from outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALLED_AS = {"deltafin": "deltafin", "coordinator": "deltafin/coordinator", "worker": "deltafin/worker"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of a copy of the checkout's files (git's tracked and unignored ones): a build in the checkout
    itself would pack what an earlier build left in build/."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in _checkout_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(source)], check=True, capture_output=True)
    (built,) = out.glob("deltafin-*.whl")
    return built


def _checkout_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode()
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def _shipped() -> set[str]:
    """The checkout's files under the package folders, as the wheel must name them."""
    names = set()
    for name in _checkout_files():
        folder, _, rest = name.partition("/")
        if folder in INSTALLED_AS and rest:
            names.add(f"{INSTALLED_AS[folder]}/{rest}")
    return names


def test_the_wheel_holds_every_package_folder_and_file(wheel: Path) -> None:
    """A folder left out of the wheel (deltafin.formats once was) fails every command at import."""
    names = set(zipfile.ZipFile(wheel).namelist())
    assert sorted(_shipped() - names) == []
    packages = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert {"deltafin/formats", "deltafin/coordinator/http", "deltafin/worker"} <= packages
    assert not any(n.startswith(("coordinator/", "worker/", "tests/")) for n in names)  # no generic top-level names


def test_an_installed_wheel_runs_from_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    """The wheel unpacked alone (its imports cannot reach the checkout) loads every module and tokenizes with the
    bundled k3-mini."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    script = (  # every module imports, but for a device's optional library (triton, mlx) this machine lacks
        "import importlib, pkgutil, sys, deltafin\n"
        "assert deltafin.__file__.startswith(sys.argv[1]), deltafin.__file__\n"
        "for m in pkgutil.walk_packages(deltafin.__path__, 'deltafin.'):\n"
        "    try:\n"
        "        importlib.import_module(m.name) if not m.name.endswith('__main__') else None\n"
        "    except ModuleNotFoundError as e:\n"
        "        assert not e.name.startswith('deltafin'), e\n"
        "from deltafin.cli.commands import main\n"
        "sys.exit(main(['tokenize', '--model', 'k3-mini', 'def f():']))\n")
    # -S: no site, so no .pth file runs (an editable install's finder would reach the checkout); the libraries
    # come from this environment's site-packages, named on the path after the unpacked wheel
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]])}
    done = subprocess.run([sys.executable, "-S", "-c", script, str(target)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ids = [int(t) for t in done.stdout.strip().strip("[]").split(",")]
    assert len(ids) >= 2 and all(i >= 0 for i in ids)
