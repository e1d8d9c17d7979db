"""The validation record: a family is stable only for the exact sources a GPU run tested."""

import json

import pytest

from tilenorm import validation


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    src = tmp_path / "pkg"
    (src / "cutile").mkdir(parents=True)
    (src / "cutile" / "k.py").write_text("kernel v1\n")
    family = validation.KernelFamily("cutile/k", "cuTile", ("cutile/k.py",))
    monkeypatch.setattr(validation, "PACKAGE_DIR", src)
    monkeypatch.setattr(validation, "RECORD_FILE", src / "validation.json")
    monkeypatch.setattr(validation, "FAMILIES", (family,))
    validation._digest.cache_clear()
    validation._records.cache_clear()
    yield src, family
    validation._digest.cache_clear()
    validation._records.cache_clear()


def write_junit(path, tests, failures=0):
    path.write_text(f'<testsuites><testsuite tests="{tests}" failures="{failures}" '
                    f'errors="0" skipped="0"/></testsuites>')


def summary(tmp_path, family, failures=0):
    junit = tmp_path / "junit.xml"
    write_junit(junit, 10, failures)
    data = {"device": "NVIDIA H200", "arch": "sm_90", "date": "2026-11-21", "commit": "abc",
            "torch": "x", "tests": validation._junit_counts(junit),
            "source_sha256": {family.name: family.digest()}}
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(data))
    return path


def test_record_marks_stable_until_the_source_changes(sandbox, tmp_path):
    src, family = sandbox
    assert not validation.is_stable(family)
    assert validation.record(summary(tmp_path, family)) == ["cutile/k"]
    validation._records.cache_clear()
    record = validation.validation_record(family)
    assert record["device"] == "NVIDIA H200" and record["tests"].startswith("10 passed")
    (src / "cutile" / "k.py").write_text("kernel v2\n")
    validation._digest.cache_clear()
    assert not validation.is_stable(family), "an edited kernel is experimental again"


def test_failed_runs_are_not_recorded(sandbox, tmp_path):
    _, family = sandbox
    with pytest.raises(SystemExit, match="did not pass"):
        validation.record(summary(tmp_path, family, failures=1))


def test_stale_summary_is_not_recorded(sandbox, tmp_path):
    src, family = sandbox
    path = summary(tmp_path, family)
    (src / "cutile" / "k.py").write_text("kernel v2\n")
    validation._digest.cache_clear()
    assert validation.record(path) == []


def test_record_of_named_families_leaves_the_others(sandbox, tmp_path, monkeypatch):
    src, family = sandbox
    (src / "cutile" / "j.py").write_text("kernel v1\n")
    other = validation.KernelFamily("cutile/j", "cuTile", ("cutile/j.py",))
    monkeypatch.setattr(validation, "FAMILIES", (family, other))
    path = summary(tmp_path, family)
    data = json.loads(path.read_text())
    data["source_sha256"][other.name] = other.digest()
    path.write_text(json.dumps(data))
    assert validation.record(path, ["cutile/j"]) == ["cutile/j"]
    validation._records.cache_clear()
    assert validation.is_stable(other) and not validation.is_stable(family)
    with pytest.raises(SystemExit, match="no kernel family"):
        validation.record(path, ["cutile/nope"])


def test_shipped_record_names_known_families():
    data = json.loads(validation.RECORD_FILE.read_text())
    assert set(data["kernels"]) <= {f.name for f in validation.FAMILIES}


def test_a_family_whose_modules_are_missing_is_not_runnable():
    """A GPU run without the CuTe DSL skips the CuTe tests: summarize leaves that family out,
    so the run cannot validate it."""
    family = validation.KernelFamily("x/y", "X", ("settings.py",), lambda: False)
    assert not family.runnable()
    assert validation.CUTILE_NORM.runnable()


#: Host code in a family's digest: the C++ of a call path that only a GPU runs end to end
#: (the XLA FFI handler of JAX's CuTe DSL calls), and the CuTe DSL launch layer (operand
#: layouts, compile options, the loaded library), validated with the kernels they serve.
GPU_ONLY_HOST_CODE = {"jax/cute_ffi_calls.cc", "launch/cute.py", "launch/cute_cache.py"}


def test_digest_covers_the_kernels_folder_and_the_measured_settings():
    """Host code outside tilenorm/kernels, the settings files (settings.py, settings_fp8.py)
    and the GPU-only host code named above can change without a GPU re-run; every kernel
    file is in some family, and the CuTe DSL launch layer in every CuTe DSL family."""
    kernel_files = {f"kernels/{p.name}" for p in (validation.PACKAGE_DIR / "kernels").glob(
        "*.py") if p.name != "__init__.py"}
    sources = {s for family in validation.FAMILIES for s in family.sources}
    assert {s for s in sources if s.startswith("kernels/")} == kernel_files
    assert sources == kernel_files | {"settings.py", "settings_fp8.py"} | GPU_ONLY_HOST_CODE
    for source in GPU_ONLY_HOST_CODE:
        assert (validation.PACKAGE_DIR / source).is_file(), source
    for family in validation.FAMILIES:
        assert (set(validation.CUTE_LAUNCH) <= set(family.sources)) == (
            family.language == "CuTe DSL"), family.name


def test_jax_cute_calls_are_a_family_of_their_own():
    """JAX's CuTe DSL calls are validated apart from the kernels' torch path: their handler,
    the kernels they call (the row and cluster forwards, the cluster backward and the
    reduction of its partial buffer, with the module they import) and the settings."""
    family = validation.CUTE_JAX
    assert family in validation.FAMILIES and family.name == "cute/jax"
    assert set(family.sources) == {
        "jax/cute_ffi_calls.cc", "kernels/cute_row_norm_forward.py",
        "kernels/cute_cluster_norm_forward.py", "kernels/cute_cluster_norm_backward.py",
        "kernels/cute_rows.py", "kernels/cute_cluster_rows.py", "kernels/cutile_column_sums.py",
        "settings.py", "launch/cute.py", "launch/cute_cache.py"}
    assert family.digest() != validation.CUTE_NORM.digest()


@pytest.mark.parametrize("source", ["kernels/cute_cluster_norm_forward.py",
                                    "kernels/cute_cluster_norm_backward.py",
                                    "kernels/cute_cluster_rows.py"])
def test_the_cluster_kernels_are_in_the_cute_and_jax_families(source):
    """The cluster kernels run from the torch ops' CuTe DSL path and from JAX's calls, and so
    does what they share (cute_cluster_rows.py, apart from cute_rows.py, which the FP8 family
    pins too): an edit asks both families for a GPU re-run, never the FP8 one."""
    assert [f for f in validation.FAMILIES if source in f.sources] == [validation.CUTE_NORM,
                                                                       validation.CUTE_JAX]


def test_a_family_holds_the_kernel_modules_its_kernels_import():
    """A kernel module shared by several kernels (cute_rows.py) is in every family whose
    kernels import it, so that an edit there asks each of them for a GPU re-run."""
    import ast

    for family in validation.FAMILIES:
        for source in family.sources:
            if not source.startswith("kernels/"):  # host code: it serves every kernel
                continue
            tree = ast.parse((validation.PACKAGE_DIR / source).read_text())
            imported = {node.module for node in ast.walk(tree)
                        if isinstance(node, ast.ImportFrom) and node.module}
            for module in imported:
                if module.startswith("tilenorm.kernels."):
                    needed = "kernels/" + module.rsplit(".", 1)[1] + ".py"
                    assert needed in family.sources, (family.name, source, needed)
