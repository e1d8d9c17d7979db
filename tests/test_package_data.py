"""Every file beside tilenorm's modules that the package opens at run time (a C++ source it
builds on first use, a header, the validation record) ships in the wheel: named in
pyproject.toml's package data, since setuptools packs only .py files otherwise."""

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tilenorm"


def test_files_the_package_opens_are_package_data():
    shipped = set(tomllib.loads((ROOT / "pyproject.toml").read_text())
                  ["tool"]["setuptools"]["package-data"]["tilenorm"])
    opened = set()
    for module in PACKAGE.rglob("*.py"):
        for name in re.findall(r'Path\(__file__\)\.with_name\("([^"]+)"\)', module.read_text()):
            if not name.endswith(".py"):
                opened.add(str((module.parent / name).relative_to(PACKAGE)))
    assert opened, "the scan found the sources the package builds"
    assert opened <= shipped, f"not shipped in the wheel: {sorted(opened - shipped)}"
    for name in shipped:
        assert (PACKAGE / name).is_file(), f"package data {name} does not exist"
