"""tilenorm's declared dependencies install beside each supported CUDA build of torch.

For each torch release line, pip's resolver plans (``pip install --dry-run --report``, nothing
installed) torch pinned to that line's newest release together with every dependency in
pyproject.toml, for the GPU host's platform: CPython 3.12 on manylinux x86-64. The plan must
keep torch at the pinned version, add no ``cuda-toolkit`` constraint of tilenorm's own (the
meta-package is in the plan only at the version that torch itself pins), take the CuTe DSL's
CUDA 13 libraries without the CUDA 12 ones, and put cuTile's compiler trio (tileiras, nvcc,
nvvm) on one CUDA release, 13.3 or newer, as cuda-tile needs to use it.

What PyPI's Linux x86-64 wheels of torch require (read from their metadata, November 2026):

- 2.9.0, 2.9.1 and 2.10.0: CUDA 12.8 (``nvidia-*-cu12`` wheels, no ``cuda-toolkit``
  meta-package; 2.10.0 also pins ``cuda-bindings==12.9.4``);
- 2.11.0 and 2.12.x: CUDA 13.0, ``cuda-toolkit[...]==13.0.2``, ``cuda-bindings>=13.0.3,<14``;
- 2.13.0 and 2.14.x: ``cuda-toolkit[...]==13.0.3``;
- 2.15.0 (the newest then): ``cuda-toolkit[...]==13.2.2``.

None of them asks for the toolkit's nvcc, nvvm or tileiras extras, so the component wheels
resolve beside every one; the old requirement ``cuda-toolkit[nvcc,nvvm,tileiras]>=13.3`` does
not (:func:`test_old_toolkit_requirement_conflicts`).

The resolver runs as pip 26.3 (:data:`PIP`, fetched as a wheel and run from it) with
``--use-feature=fast-deps``: pip >= 25.3 no longer downloads every wheel in a dry run, and the
package index reached here serves no PEP 658 metadata files, so without fast-deps (metadata
read through HTTP range requests) pip would fetch each torch wheel whole (0.5-0.9 GB). Each
resolution then takes about 4 s. The tests skip only where the index cannot be reached.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.install

ROOT = Path(__file__).resolve().parent.parent

#: The pip that resolves: >= 25.3 for dry runs that download no wheel; pinned so that
#: --use-feature=fast-deps (experimental) stays as verified.
PIP = "26.3"

#: The GPU host: CPython 3.12, x86-64, glibc 2.39. pip does not widen a --platform tag to the
#: older manylinux tags a machine also accepts, so every one is named.
TARGET = [
    "--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
    *[arg for minor in range(39, 4, -1) for arg in ("--platform", f"manylinux_2_{minor}_x86_64")],
    "--platform", "manylinux2014_x86_64", "--platform", "manylinux2010_x86_64",
    "--platform", "manylinux1_x86_64",
]
#: Environment markers of that host, for torch's own requirements.
MARKERS = {
    "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
    "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
    "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": "",
}

#: torch release lines whose install is checked: "newest" is the index's newest release.
TORCH_LINES = {"2.9": "torch==2.9.*", "2.10": "torch==2.10.*", "2.11": "torch==2.11.*",
               "newest": "torch"}

#: cuTile's compiler and the ptxas and libnvvm it runs: cuda-tile uses these wheels only when
#: all three share one major.minor.
TOOLCHAIN = ("nvidia-cuda-tileiras", "nvidia-cuda-nvcc", "nvidia-nvvm")

#: What tilenorm required before it took the component wheels (pyproject.toml, issue 15).
OLD_TOOLKIT = ["cuda-toolkit[nvcc,nvvm,tileiras]>=13.3", "cuda-tile[tileiras]>=1.7"]

TIMEOUT_S = 150


def dependencies() -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        pytest.skip("reading pyproject.toml needs tomllib (Python >= 3.11)")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


def _require_index() -> None:
    """Skip when the package index cannot be reached; anything after that must work."""
    if os.environ.get("PIP_NO_INDEX", "").lower() in ("1", "true", "yes", "on"):
        pytest.skip("PIP_NO_INDEX is set: no package index to resolve against")
    url = urlsplit(os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple"))
    if url.scheme not in ("http", "https"):
        return
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=5).close()
    except OSError as e:
        pytest.skip(f"package index {url.hostname}:{port} unreachable ({e})")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
               PIP_REQUIRE_VIRTUALENV="0")
    return env


@pytest.fixture(scope="session")
def pip(tmp_path_factory) -> list[str]:
    """The command that runs pip :data:`PIP` (a wheel run in place, installing nothing)."""
    _require_index()
    folder = tmp_path_factory.mktemp("pip")
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
         "--only-binary=:all:", "--dest", str(folder), f"pip=={PIP}"],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=_env())
    assert got.returncode == 0, f"could not fetch pip {PIP}:\n{got.stderr}"
    (wheel,) = folder.glob("pip-*.whl")
    return [sys.executable, str(wheel / "pip")]


def resolve(pip: list[str], requirements: list[str], report: Path,
            *options: str) -> tuple[subprocess.CompletedProcess, float]:
    """pip's plan for ``requirements`` on the GPU host's platform, and the seconds it took."""
    command = [*pip, "install", "--dry-run", "--ignore-installed", "--quiet",
               "--use-feature=fast-deps", "--report", str(report), *options, *TARGET,
               *requirements]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=_env())
    return done, time.monotonic() - start


def plan(report: Path) -> dict[str, dict]:
    """Each project in a pip report's plan, by canonical name, to its metadata."""
    installs = json.loads(report.read_text())["install"]
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in installs}


def torch_toolkit_pin(torch_metadata: dict) -> SpecifierSet | None:
    """The ``cuda-toolkit`` versions that torch itself asks for on the GPU host, if any."""
    for line in torch_metadata.get("requires_dist") or []:
        req = Requirement(line)
        if canonicalize_name(req.name) == "cuda-toolkit" and (
                req.marker is None or req.marker.evaluate(MARKERS)):
            return req.specifier
    return None


@pytest.mark.parametrize("line", list(TORCH_LINES))
def test_installs_beside_torch(pip, line, tmp_path):
    # The release to pin: the newest of the line, found alone, so that a conflict with it
    # fails here instead of the resolver backing off to an older torch.
    found, _ = resolve(pip, [TORCH_LINES[line]], tmp_path / "torch.json", "--no-deps")
    assert found.returncode == 0, found.stderr
    version = plan(tmp_path / "torch.json")["torch"]["version"]
    if line != "newest":
        assert version in SpecifierSet(f"=={line}.*")

    deps = dependencies()
    done, seconds = resolve(pip, [f"torch=={version}", *deps], tmp_path / "plan.json")
    print(f"torch {version}: resolved in {seconds:.1f} s")
    assert done.returncode == 0, (
        f"tilenorm's dependencies do not install beside torch {version}:\n{done.stderr}")
    got = plan(tmp_path / "plan.json")
    versions = {name: Version(meta["version"]) for name, meta in got.items()}

    assert versions["torch"] == Version(version)
    for dep in deps:
        assert canonicalize_name(Requirement(dep).name) in got, f"{dep} not in the plan"
    for unwanted in ("nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl"):
        assert unwanted not in got, f"{unwanted} {versions[unwanted]} in the plan"

    pin = torch_toolkit_pin(got["torch"])
    if pin is None:
        assert "cuda-toolkit" not in got, (
            f"torch {version} pins no cuda-toolkit, yet the plan has {versions['cuda-toolkit']}")
    else:
        assert "cuda-toolkit" in got, f"torch {version} pins cuda-toolkit{pin}: not in the plan"
        assert versions["cuda-toolkit"] in pin, (
            f"cuda-toolkit {versions['cuda-toolkit']}, but torch {version} pins {pin}")

    releases = {name: versions[name].release[:2] for name in TOOLCHAIN}
    assert len(set(releases.values())) == 1, f"toolchain on different releases: {releases}"
    assert releases["nvidia-cuda-tileiras"] >= (13, 3), releases
    print("  " + ", ".join(f"{name} {versions[name]}" for name in
                           ("cuda-toolkit", *TOOLCHAIN, "cuda-bindings", "cuda-tile",
                            "nvidia-cutlass-dsl-libs-cu13", "apache-tvm-ffi")
                           if name in versions))


def test_old_toolkit_requirement_conflicts(pip, tmp_path):
    """The check can fail: the meta-package requirement tilenorm had conflicts with torch
    2.11's pin (cuda-toolkit 13.0.2)."""
    done, seconds = resolve(pip, ["torch==2.11.0", *OLD_TOOLKIT], tmp_path / "old.json")
    print(f"old requirement beside torch 2.11.0: pip answered in {seconds:.1f} s")
    assert done.returncode != 0, "the old cuda-toolkit requirement resolved beside torch 2.11"
    assert "ResolutionImpossible" in done.stderr, done.stderr
