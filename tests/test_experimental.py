"""The experimental flag and what explain() reports, with and without it."""

import pytest
import torch

import tilenorm
from tilenorm import _experimental, dispatch, validation
from tilenorm.device import DeviceInfo
from tilenorm.launch import cute
from tilenorm.settings import SM90

FAKE_H100 = DeviceInfo(index=0, name="NVIDIA H100 80GB HBM3", sm_count=132, arch=(9, 0),
                       l2_bytes=50 << 20)


@pytest.mark.parametrize("raw,value", [("1", True), ("true", True), ("ON", True),
                                       ("0", False), ("", False), ("off", False)])
def test_env_var_parsing(monkeypatch, raw, value):
    monkeypatch.setenv("TILENORM_EXPERIMENTAL", raw)
    assert _experimental._from_env() is value


def test_env_var_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv("TILENORM_EXPERIMENTAL", "maybe")
    with pytest.raises(ValueError, match="TILENORM_EXPERIMENTAL"):
        _experimental._from_env()


def test_setter_and_context_manager_restore():
    before = tilenorm.experimental_enabled()
    with tilenorm.experimental():
        assert tilenorm.experimental_enabled()
        with tilenorm.experimental(False):
            assert not tilenorm.experimental_enabled()
        assert tilenorm.experimental_enabled()
    assert tilenorm.experimental_enabled() == before
    with pytest.raises(RuntimeError), tilenorm.experimental():
        raise RuntimeError
    assert tilenorm.experimental_enabled() == before
    tilenorm.set_experimental(True)
    assert tilenorm.experimental_enabled()
    tilenorm.set_experimental(before)
    with pytest.raises(TypeError):
        tilenorm.set_experimental(1)


def test_explain_on_cpu_names_the_reference_and_why():
    text = str(tilenorm.explain(torch.randn(4, 64)))
    assert "reference path" in text and "cpu" in text


@pytest.fixture
def fake_gpu(monkeypatch):
    """Decide as if x lived on an H100: the decision needs only the device's properties (and
    how many clusters of a shape it holds at once: two of eight CTAs a GPC an SM)."""
    monkeypatch.setattr(dispatch, "device_info", lambda index: FAKE_H100)
    monkeypatch.setattr(dispatch, "max_active_clusters",
                        lambda index, cluster, threads, ctas_per_sm: 16 * ctas_per_sm)
    dispatch.decide.cache_clear()
    yield
    dispatch.decide.cache_clear()


def route_on_fake_gpu(rows, cols, dtype="bfloat16", allow=False):
    return dispatch.decide(dispatch.Problem("rms_norm", "cuda", 0, (dtype,), rows, 1, cols,
                                            False, rows * cols - 1, allow))


@pytest.mark.parametrize("stable", [True, False])
def test_experimental_kernels_run_only_when_allowed(fake_gpu, monkeypatch, stable):
    monkeypatch.setattr(validation, "is_stable", lambda family: stable)
    off = route_on_fake_gpu(32768, 4096, allow=False)
    on = route_on_fake_gpu(32768, 4096, allow=True)
    assert on.uses_kernel
    assert off.uses_kernel == stable
    if not stable:
        assert "experimental" in str(off) and "TILENORM_EXPERIMENTAL=1" in str(off)


def test_explain_describes_kernel_tile_grid_and_partial_buffer(fake_gpu):
    text = str(route_on_fake_gpu(32768, 4096, allow=True))
    for words in ("cuTile", "norm_fwd_single", "norm_bwd_single", "column_sums",
                  "tile 1x4096", "persistent grid 264", "partial buffer 264x4096 fp32",
                  "NVIDIA H100", "status:"):
        assert words in text, words
    wide = str(route_on_fake_gpu(1024, 65536, allow=True))
    assert "norm_fwd_chunked" in wide and "16 column chunks" in wide, wide


@pytest.mark.parametrize("cols,names", [
    (4096, ("norm_fwd_single", "norm_bwd_single")),
    (5120, ("norm_fwd_split", "norm_bwd_split")),
    (3000, ("norm_fwd_single", "norm_bwd_split")),
    (20000, ("norm_fwd_split", "norm_bwd_row_sums", "norm_bwd_columns")),
    (30000, ("norm_fwd_single", "norm_bwd_row_sums", "norm_bwd_columns")),
    (65536, ("norm_fwd_chunked", "norm_bwd_row_sums", "norm_bwd_columns")),
])
def test_explain_names_the_kernels_each_direction_runs(fake_gpu, cols, names):
    """Each direction's plan picks its kernels: a row may be single-pass forward and column
    split backward, or split in one direction only. The CuTe DSL forward, where it is
    installed and the width is in its table, comes first: a call takes it or cuTile's."""
    route = route_on_fake_gpu(1024, cols, allow=True)
    cute_forward = (dispatch.cute_forward_name(route.cute_forward),) if route.cute_forward \
        else ()
    cute_backward = (dispatch.CUTE_CLUSTER_BACKWARD_NAME,) if route.cute_backward else ()
    assert route.kernels == (*cute_forward, *names, *cute_backward, "column_sums"), route
    assert (route.cute_backward is not None) == (
        cute.available() and cols in SM90.cute_cluster_backward["rms_norm"])
    assert (route.cute_forward is not None) == (
        cute.available() and cols in SM90.cute_forward["rms_norm"]
        and 1024 * cols * 2 >= dispatch.CUTE_FORWARD_MIN_BYTES)
    if cols == 65536 and route.cute_forward:  # a row across a cluster of CTAs
        assert route.kernels[0] == dispatch.CUTE_CLUSTER_FORWARD_NAME


def test_reference_for_unsupported_dtype_and_size(fake_gpu):
    assert "float64" in route_on_fake_gpu(8, 64, "float64", allow=True).reason
    big = route_on_fake_gpu(2**16, 2**15 + 1, allow=True)
    assert big.uses_kernel and "64-bit offsets" in str(big)


def test_weights_that_do_not_flatten_take_the_reference_path(fake_gpu):
    """The kernels read a weight or bias as one strided vector: a multi-dimensional one
    whose strides do not flatten (a transposed 2-D weight) is not one, and runs the
    reference path, with the reason."""
    from tilenorm.pytorch.calls import flat_strided

    w = torch.randn(4, 8)
    assert flat_strided(w) and flat_strided(w[:, ::2].contiguous()) and flat_strided(w[0])
    assert flat_strided(torch.randn(8, 1)) and flat_strided(torch.randn(1, 8)[:, ::2])
    assert not flat_strided(w.t()) and not flat_strided(w[:, :4]) and not flat_strided(w[::2])
    p = dispatch.Problem("rms_norm", "cuda", 0, ("bfloat16",), 64, 1, 32, False, 64 * 32 - 1,
                         True, flat_params=False)
    decision = dispatch.decide(p)
    assert not decision.uses_kernel and "strides do not flatten" in str(decision)
