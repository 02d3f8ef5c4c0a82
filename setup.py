"""The packages, found rather than listed: everything under deltafin/, plus the product card's top-level coordinator/
and worker/, which install as deltafin.coordinator and deltafin.worker (so no generic top-level names are installed).
The rest of the metadata is pyproject.toml's; tests/test_packaging.py builds the wheel and checks it is whole."""

from setuptools import find_packages, setup

MAPPED = {"deltafin.coordinator": "coordinator", "deltafin.worker": "worker"}  # install name -> folder


def _packages() -> list[str]:
    found = find_packages(include=["deltafin", "deltafin.*"])
    for name, folder in MAPPED.items():
        found += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]
    return sorted(found)


setup(packages=_packages(), package_dir={"deltafin": "deltafin", **MAPPED})
