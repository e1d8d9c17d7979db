"""Per-device settings on Hopper: a device's class (from its peak DRAM bandwidth) picks the
H100's or the H200's tables, which differ exactly where the two measured other choices (#38,
#82); the planner and the decisions take the device's class, and the ahead-of-time builds
cover every class's entries."""

import dataclasses

import pytest

from tests.kernel_harness import H100, H200
from tilenorm import dispatch
from tilenorm.device import DeviceInfo
from tilenorm.launch import aot, cute
from tilenorm.planner import (
    is_persistent,
    plan_cute_backward,
    plan_cute_fp8_forward,
    plan_row_norm,
)
from tilenorm.settings import (
    DEFAULT_DEVICE_CLASS,
    DEVICE_CLASSES,
    H100_PEAK_BANDWIDTH,
    SM90,
    SM90_H100,
    device_class,
    measuring,
    settings_for,
)
from tilenorm.settings_fp8 import (
    SM90_FP8,
    SM90_FP8_H100,
    fp8_settings_for,
    row_settings_for,
)

gpu = pytest.mark.gpu
needs_cute = pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")


def peak(memory_clock_mhz: int, bus_bits: int) -> int:
    """Peak DRAM bandwidth as :func:`tilenorm.device.device_info` computes it."""
    return 2 * memory_clock_mhz * 10**6 * bus_bits // 8


def fake(name: str, bandwidth: int, arch=(9, 0)) -> DeviceInfo:
    return DeviceInfo(index=0, name=name, sm_count=132, arch=arch, l2_bytes=50 << 20,
                      memory_bandwidth=bandwidth)


#: Devices by their peak bandwidth (memory clock in MHz and bus width in bits, or the
#: datasheet's bytes a second), with the class each must get.
DEVICES = [
    ("H100 SXM", (9, 0), peak(2619, 5120), "h100"),
    ("H100 PCIe", (9, 0), peak(1593, 5120), "h100"),
    ("H800", (9, 0), peak(2619, 5120), "h100"),
    ("H200", (9, 0), 4800 * 10**9, "h200"),
    ("H100 NVL", (9, 0), 3900 * 10**9, "h200"),
    ("unknown bandwidth", (9, 0), 0, "h200"),
    ("Blackwell", (10, 0), peak(2619, 5120), "h200"),
]


@pytest.mark.parametrize("name,arch,bandwidth,expected", DEVICES,
                         ids=[d[0] for d in DEVICES])
def test_device_class_from_the_peak_bandwidth(name, arch, bandwidth, expected):
    """The H100's tables for sm_90 at most at the H100 SXM's bandwidth; every other device,
    one not recognised included, keeps the tables measured first (the H200's)."""
    assert device_class(arch, bandwidth) == expected
    assert fake(name, bandwidth, arch).device_class == expected
    assert DEFAULT_DEVICE_CLASS == "h200" == DEVICE_CLASSES[0]
    assert peak(2619, 5120) == H100_PEAK_BANDWIDTH


def test_each_class_has_its_own_settings_objects():
    """Constants, returned by identity: plans are cached per settings object. Blackwell takes
    the default class's until measured; a class not known is refused."""
    assert settings_for((9, 0)) is settings_for((9, 0), "h200") is SM90
    assert settings_for((9, 0), "h100") is SM90_H100
    assert settings_for((10, 0)) is SM90
    assert fp8_settings_for((9, 0)) is fp8_settings_for((9, 0), "h200") is SM90_FP8
    assert fp8_settings_for((9, 0), "h100") is SM90_FP8_H100
    for device in DEVICE_CLASSES:
        assert row_settings_for((9, 0), device) is row_settings_for((9, 0), device)
    assert row_settings_for((9, 0), "h100") is not row_settings_for((9, 0), "h200")
    for lookup in (settings_for, fp8_settings_for, row_settings_for):
        with pytest.raises(ValueError, match="device_class"):
            lookup((9, 0), "h20")


def _differences(a, b) -> dict:
    return {f.name: (getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
            if getattr(a, f.name) != getattr(b, f.name)}


def _entries(table: dict) -> dict:
    """A per-op width table's entries by (op, width)."""
    return {(op, cols): entry for op, widths in table.items() for cols, entry in widths.items()}


def test_measured_settings_replace_every_class_inside_the_context_only():
    """``measuring`` (the op benchmarks' ``--variants``) hands its settings to every lookup,
    the FP8 row settings included, and restores the class's tables after, an error too."""
    probe = dataclasses.replace(SM90, cute_backward={})
    with measuring(probe):
        assert all(settings_for((9, 0), c) is probe for c in DEVICE_CLASSES)
        assert row_settings_for((9, 0), "h100").cute_backward == {}
    with pytest.raises(RuntimeError), measuring(probe):
        raise RuntimeError
    assert settings_for((9, 0), "h100") is SM90_H100 and settings_for((9, 0)) is SM90


def test_row_plans_made_inside_measuring_take_the_measured_settings():
    """A plan cached before ``measuring`` is not handed out inside it, nor the measured one
    after: the planner's cache is keyed by the settings it resolved."""
    kwargs = dict(itemsize=2, sm_count=132, arch=(9, 0), direction="forward")
    before = plan_row_norm(4096, 1024, **kwargs)
    probe = dataclasses.replace(SM90, tile_elements={"forward": 2048, "backward": 2048})
    assert probe.tile_elements != SM90.tile_elements
    with measuring(probe):
        inside = plan_row_norm(4096, 1024, **kwargs)
    assert inside == plan_row_norm(4096, 1024, settings=probe, **kwargs)
    assert (inside.tile_rows, before.tile_rows) == (2048 // 1024,
                                                     SM90.tile_elements["forward"] // 1024)
    assert plan_row_norm(4096, 1024, **kwargs) == before


def test_the_h100_tables_differ_exactly_where_the_h100_measured_otherwise():
    """The LayerNorm backward at 4096 columns leaves the CuTe DSL for cuTile's (#38), and the
    H200's RMSNorm row backwards at 1024, 7168 and 8192 (#122, #125), forwards at 512 and
    1024 and LayerNorm's cluster backward at 131072 (#122) are untimed there; the RMSNorm
    forward at 32768 keeps one CTA a row (#69) and at 65536 holds two rows a cluster (#95,
    level on an H200: #98); the LayerNorm forward at 32768-131072 keeps the one-shot
    cluster forward where the H200 runs the persistent one (#103, #125);
    the FP8 row kernel of 2-byte x at 8192 columns runs at (512, 2, 2) (#82), at 4096 for
    row and MX scaling at (256, 4, 2) (#95), clamps nowhere (timed on the H200 only,
    #125) and recomputes t at 16384 for block scaling only (the H200 for row and MX too,
    #122); a per-row copy's column amaxes come from the CuTe row kernel at every width of
    both (#103, #120), at row scaling's plan (#125). FP8 x keeps its own entry (#88, #95).
    The FP8 row kernel's rings in shared memory are the H200's alone (#133).
    fp32 x at 16384 takes 2-byte x's 32768 entry, one CTA a row. The cluster backward's
    staged stats are the H200's alone (#134), and so are the RMSNorm forwards at 2048 and
    7168's 224 threads, the 128-column backward of many rows (#135) and block scaling's own
    layouts at 4096 / 8192 (#135), and the two-pass RMSNorm forward at 4096-32768 (#138).
    Nothing else differs."""
    assert set(_differences(SM90, SM90_H100)) == {"cute_backward", "cute_cluster_backward",
                                                  "cute_cluster_backward_staged_stats",
                                                  "cute_forward", "cute_forward_fp32",
                                                  "cute_forward_two_pass",
                                                  "many_rows_hints"}
    assert SM90_H100.cute_forward_two_pass == {"rms_norm": {}, "layer_norm": {}}
    assert SM90_H100.cute_backward == {}
    assert SM90_H100.many_rows_hints == {"forward": {}, "backward": {}}
    assert SM90.many_rows_hints["backward"] == {"rms_norm": ((524288, (128, 4, 4, True)),)}
    assert SM90.cute_cluster_backward_staged_stats
    assert SM90_H100.cute_cluster_backward_staged_stats == {}
    assert _entries(SM90.cute_backward) == {("layer_norm", 4096): (256, 2, 2),
                                            ("rms_norm", 1024): (128, 4, 4),
                                            ("rms_norm", 7168): (448, 2, 1),
                                            ("rms_norm", 8192): (512, 2, 1)}
    h200, h100 = (_entries(SM90.cute_cluster_backward),
                  _entries(SM90_H100.cute_cluster_backward))
    assert h200 == {**h100, ("layer_norm", 131072): (8, 512, 2, 1)} and len(h200) == len(h100)
    h200, h100 = _entries(SM90.cute_forward), _entries(SM90_H100.cute_forward)
    assert h100 == {**{k: v for k, v in h200.items()
                       if k not in (("rms_norm", 512), ("rms_norm", 1024), ("rms_norm", 2048))},
                    ("rms_norm", 7168): (128, 1, 4),
                    ("rms_norm", 32768): (512, 1, 1), ("rms_norm", 65536): (256, 2, 4, 8),
                    ("layer_norm", 32768): (256, 2, 4, 4),
                    ("layer_norm", 65536): (256, 1, 4, 4),
                    ("layer_norm", 131072): (256, 1, 4, 8)}
    assert len(h100) == len(h200) - 3
    assert {k: v for k, v in h200.items() if is_persistent(v)} == {
        ("layer_norm", 32768): (256, 1, 2, 4, 2), ("layer_norm", 65536): (256, 2, 1, 8, 3),
        ("layer_norm", 131072): (256, 1, 1, 8, 2)}
    h200, h100 = _entries(SM90.cute_forward_fp32), _entries(SM90_H100.cute_forward_fp32)
    assert h100 == {**h200, ("rms_norm", 16384): (512, 1, 1)} and len(h100) == len(h200)
    assert set(_differences(SM90_FP8, SM90_FP8_H100)) == {"cute_forward",
                                                          "cute_forward_scaling",
                                                          "cute_forward_clamp",
                                                          "cute_forward_recompute_t",
                                                          "cute_forward_fp8_input_scaling",
                                                          "cute_forward_shared_ring",
                                                          "cute_forward_fp8_input_shared_ring"}
    assert SM90_FP8.cute_forward_shared_ring and SM90_FP8.cute_forward_fp8_input_shared_ring
    assert SM90_FP8_H100.cute_forward_shared_ring == {}
    assert SM90_FP8_H100.cute_forward_fp8_input_shared_ring == {}
    assert SM90_FP8.cute_forward_clamp and SM90_FP8_H100.cute_forward_clamp == {}
    # FP8 x's row-scaling entries of the H200 (bench/NOTES.md #128), untimed on an H100.
    assert set(SM90_FP8.cute_forward_fp8_input_scaling) == {"row"}
    assert SM90_FP8_H100.cute_forward_fp8_input_scaling == {}
    assert SM90_FP8.cute_forward_recompute_t == {
        scaling: {16384: (256, 2, 2)} for scaling in ("block", "row", "mx")}
    assert SM90_FP8_H100.cute_forward_recompute_t == {"block": {16384: (256, 2, 2)}}
    for f in (SM90_FP8, SM90_FP8_H100):
        assert set(f.cute_forward_column_amax) == set(f.cute_forward)
    assert SM90_FP8_H100.cute_forward == {**SM90_FP8.cute_forward, 8192: (512, 2, 2)}
    assert SM90_FP8.cute_forward[8192] == (256, 4, 2)
    assert SM90_FP8.cute_forward_scaling == {"block": {4096: (256, 4, 3), 8192: (512, 4, 1)}}
    assert SM90_FP8_H100.cute_forward_scaling == {"row": {4096: (256, 4, 2)},
                                                  "mx": {4096: (256, 4, 2)}}
    assert SM90_FP8_H100.cute_forward_fp8_input[8192] == (256, 4, 2)
    row_h200, row_h100 = row_settings_for((9, 0), "h200"), row_settings_for((9, 0), "h100")
    assert set(_differences(row_h200, row_h100)) == {"cute_backward", "cute_cluster_backward",
                                                    "cute_cluster_backward_staged_stats",
                                                    "cute_forward", "cute_forward_fp32",
                                                    "cute_forward_two_pass"}


@pytest.mark.parametrize("settings", [SM90, SM90_H100])
def test_a_cute_table_is_chosen_by_kernel_and_element_size(settings):
    """2-byte x (bf16, fp16) and fp32 x take their own tables; the row backward has no fp32
    table, and no other element size has any."""
    assert settings.cute_table("forward", 2) is settings.cute_forward
    assert settings.cute_table("forward", 4) is settings.cute_forward_fp32
    assert settings.cute_table("backward", 2) is settings.cute_backward
    assert settings.cute_table("cluster_backward", 2) is settings.cute_cluster_backward
    assert settings.cute_table("cluster_backward", 4) is settings.cute_cluster_backward_fp32
    assert settings.cute_table("backward", 4) == {}
    assert all(settings.cute_table(kernel, itemsize) == {}
               for kernel in ("forward", "backward", "cluster_backward") for itemsize in (1, 8))


def test_an_fp8_scaling_entry_replaces_the_width_entry_of_that_scaling_only():
    """Row and MX scaling at 4096 columns run (256, 4, 2) on an H100, block and the per-tensor
    scalings the width's (128, 4, 4) (block (256, 4, 3) on an H200); a per-row scaling's
    column amaxes take row's; a width outside ``cute_forward`` has none."""
    def plan(scaling, device_class, column_amax=False):
        return plan_cute_fp8_forward(8192, 4096, itemsize=2, sm_count=132, arch=(9, 0),
                                     scaling=scaling, device_class=device_class,
                                     column_amax=column_amax)

    def entry(p):
        return p.threads, p.stages, p.ctas_per_sm

    for scaling in ("amax", "delayed", "row", "block", "mx"):
        # Block scaling has its own H200 layout (bench/NOTES.md #135).
        assert entry(plan(scaling, "h200")) == ((256, 4, 3) if scaling == "block"
                                                else (128, 4, 4))
        assert entry(plan(scaling, "h100")) == (
            (256, 4, 2) if scaling in ("row", "mx") else (128, 4, 4))
    assert entry(plan("row", "h100", column_amax=True)) == (256, 4, 2)
    assert SM90_FP8_H100.forward_entry("row", 3072) is None


def test_the_fp8_clamp_runs_on_the_h200_where_it_measured_faster():
    """The CuTe FP8 row kernel of 2-byte x clamps before the conversion on the H200 at row
    scaling's 4096 and 8192 columns and MX's 2048 and 8192, where it ran 2-4.5% faster (row
    at 2048 slower, MX at 4096 level: bench/NOTES.md #125); nowhere else, and nowhere on
    the H100 (untimed there)."""
    from tilenorm.kernels.cute_row_norm_fp8 import SCALINGS

    clamped = {("row", 4096), ("row", 8192), ("mx", 2048), ("mx", 8192)}
    for device in DEVICE_CLASSES:
        for cols in fp8_settings_for((9, 0), device).cute_forward:
            for scaling in SCALINGS:
                p = plan_cute_fp8_forward(8192, cols, itemsize=2, sm_count=132, arch=(9, 0),
                                          scaling=scaling, device_class=device)
                assert p.clamp == (device == "h200" and (scaling, cols) in clamped), (
                    device, scaling, cols)


def test_the_planner_takes_the_class_it_is_given():
    def backward(device):
        return plan_cute_backward(32768, 4096, itemsize=2, sm_count=132, arch=(9, 0),
                                  op="layer_norm", device_class=device)

    assert (backward("h200").threads, backward("h200").stages) == (256, 2)
    assert backward("h100") is None
    for scaling in ("row", "block", "mx", "amax"):
        for device, entry in (("h200", (256, 4, 2)), ("h100", (512, 2, 2))):
            p = plan_cute_fp8_forward(16384, 8192, itemsize=2, sm_count=132, arch=(9, 0),
                                      scaling=scaling, device_class=device)
            if (scaling, device) == ("block", "h200"):  # its own layout (#135)
                entry = (512, 4, 1)
            assert (p.threads, p.stages, p.ctas_per_sm) == entry, (scaling, device)
            p = plan_cute_fp8_forward(16384, 8192, itemsize=1, sm_count=132, arch=(9, 0),
                                      scaling=scaling, group=16, device_class=device)
            # FP8 x's row scaling has its own H200 entry (bench/NOTES.md #128).
            fp8x = (256, 2, 4) if (scaling, device) == ("row", "h200") else (256, 4, 2)
            assert (p.threads, p.stages, p.ctas_per_sm) == fp8x, (scaling, device)
    p = plan_cute_fp8_forward(16384, 8192, itemsize=2, sm_count=132, arch=(9, 0),
                              scaling="row", column_amax=True, device_class="h100")
    assert p.column_amax and (p.threads, p.stages, p.ctas_per_sm) == (512, 2, 2)
    # cuTile's plans are the same on both (their settings are).
    for direction in ("forward", "backward"):
        h200, h100 = (plan_row_norm(32768, 4096, itemsize=2, sm_count=132, arch=(9, 0),
                                    direction=direction, op="layer_norm", device_class=d)
                      for d in ("h200", "h100"))
        assert h200 == h100


@pytest.fixture
def on_device(monkeypatch):
    """Decide as on the device described: ``on_device(info)``."""
    def use(info: DeviceInfo) -> None:
        monkeypatch.setattr(dispatch, "device_info", lambda index: info)
        dispatch.decide.cache_clear()
        dispatch.decide_fp8.cache_clear()

    yield use
    dispatch.decide.cache_clear()
    dispatch.decide_fp8.cache_clear()




@needs_cute
def test_decisions_take_the_devices_tables_and_name_its_class(on_device):
    """The LayerNorm backward of 32768 x 4096: the CuTe DSL's on an H200, cuTile's on an
    H100; FP8 row scaling at 8192: each device's entry. The decision names the class."""
    problem = dispatch.Problem("layer_norm", "cuda", 0, ("bfloat16", "float32", "float32"),
                               32768, 1, 4096, False, 32768 * 4096 - 1, True)
    fp8_problem = dispatch.Fp8Problem("rms_norm", "cuda", 0, ("bfloat16", "bfloat16"), 16384,
                                      8192, "row", False, False, 16384 * 8192 - 1, True)
    for info, cute_backward, fp8_entry in ((H200, True, (256, 4, 2)),
                                           (H100, False, (512, 2, 2))):
        on_device(info)
        d = dispatch.decide(problem)
        assert (d.cute_backward is not None) == cute_backward, str(d)
        assert (dispatch.CUTE_BACKWARD_NAME in d.kernels) == cute_backward
        assert f"device class {info.device_class}" in str(d)
        d = dispatch.decide_fp8(fp8_problem)
        f = d.cute_forward
        assert (f.threads, f.stages, f.ctas_per_sm) == fp8_entry, str(d)
        assert f"device class {info.device_class}" in str(d)


def test_ahead_of_time_builds_cover_every_class():
    """Every CuTe DSL entry of every class's tables has its variants among the AOT keys (the
    H200's LayerNorm backward at 4096, the H100's FP8 row kernel at 8192 with every
    scaling); cuTile's exported plans cover every class's plans."""
    from tilenorm.kernels.cute_row_norm_fp8 import SCALINGS

    backward = {(k.layer_norm, k.cols, (k.threads, k.stages, k.ctas_per_sm), k.shared_ring)
                for k in cute.aot_keys()}
    forward = {(k.layer_norm, k.cols, (k.threads, k.rows_per_cta, k.ctas_per_sm)
                + ((k.cluster,) if k.cluster > 1 else ()) + ((k.stages,) if k.persistent else ()))
               for k in cute.aot_forward_keys()}
    cluster = {(k.layer_norm, k.cols, (k.cluster, k.threads, k.stages, k.ctas_per_sm),
                k.stage_stats) for k in cute.aot_cluster_backward_keys()}
    fp8 = {(k.dtype, k.scaling, k.cols, (k.threads, k.stages, k.ctas_per_sm), k.column_amax,
            k.clamp, k.recompute_t) for k in cute.aot_fp8_keys()}
    transposes = {k.cols for k in cute.aot_fp8_transpose_keys()}
    for device in DEVICE_CLASSES:
        s, f = settings_for((9, 0), device), fp8_settings_for((9, 0), device)
        for (op, cols), entry in _entries(s.cute_backward).items():
            ring = cols in s.cute_backward_shared_ring.get(op, ())
            assert (op == "layer_norm", cols, entry, ring) in backward, (device, op, cols)
        for (op, cols), entry in _entries(s.cute_forward).items():
            assert (op == "layer_norm", cols, tuple(entry)) in forward, (device, op, cols)
        for (op, cols), entry in _entries(s.cute_cluster_backward).items():
            staged = s.cluster_backward_stage_stats(op, cols, 2)
            assert (op == "layer_norm", cols, entry, staged) in cluster, (device, op, cols)
        for cols in f.cute_forward:
            for scaling in SCALINGS:
                entry, clamp = f.forward_entry(scaling, cols), f.forward_clamp(scaling, cols)
                assert ("bfloat16", scaling, cols, entry, False, clamp, False) in fp8, (
                    device, scaling, cols)
                recompute_t = f.cute_forward_recompute_t.get(scaling, {}).get(cols)
                if recompute_t:
                    assert ("bfloat16", scaling, cols, recompute_t, False, clamp, True) in fp8
            if cols in f.cute_forward_column_amax:
                # Row scaling's plan, recompute_t included (bench/NOTES.md #125).
                recompute_t = f.cute_forward_recompute_t.get("row", {}).get(cols)
                entry = recompute_t or f.forward_entry("row", cols)
                assert ("bfloat16", "row", cols, entry, True, False,
                        recompute_t is not None) in fp8, (device, cols)
            assert cols in transposes
        for cols in f.cute_forward_fp8_input:
            for scaling in SCALINGS:
                entry = f.fp8_input_entry(scaling, cols)
                assert ("float8_e4m3fn", scaling, cols, entry, False, False, False) in fp8, (
                    device, scaling, cols)
    # MX at 2048 columns, (128, 4, 6) on both classes: the H200's clamps, the H100's not.
    assert {k.clamp for k in cute.aot_fp8_keys()
            if (k.dtype, k.scaling, k.cols) == ("bfloat16", "mx", 2048)} == {False, True}
    assert len(cute.aot_fp8_keys()) == len(set(cute.aot_fp8_keys())), "each variant once"
    exported = {p.config for p in aot.plans("backward", "layer_norm")}
    for device in DEVICE_CLASSES:
        for cols in (1000, 4096, 5120, 16384, 65536):
            p = plan_row_norm(1024, cols, itemsize=2, sm_count=132, arch=(9, 0),
                              direction="backward", op="layer_norm", device_class=device)
            assert p.config in exported, (device, cols)


@gpu
def test_this_devices_class_is_its_products():
    """The driver's memory clock and bus width put an H100 (SXM or PCIe) in the H100 class
    and an H200 in the H200's: what the tables assume, checked on the device itself."""
    import torch

    from tilenorm.device import device_info

    info = device_info(torch.cuda.current_device())
    assert info.memory_bandwidth > 0, info
    if "H200" in info.name:
        assert info.device_class == "h200", info
    elif "H100" in info.name and "NVL" not in info.name:
        assert info.device_class == "h100", info
    else:
        pytest.skip(f"no expectation for {info.name}")
