"""Variants of the CuTe DSL FP8-output row kernel under measurement (not what the ops run):
subclasses of :class:`tilenorm.kernels.cute_row_norm_fp8.RowNormFp8Forward` that
``cute_fp8_probe.py --variant NAME`` compiles and times beside it, and
``fp8_block_sass.py --variants NAME`` reads off its SASS (bench/NOTES.md #58, #117). The
recompute-t variant (#74, #78) is the kernel's own ``recompute_t`` flag (``--variant
recompute-t``). Importing this module imports the CuTe DSL.
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tilenorm.launch import cute as _launch  # noqa: E402

_launch.available()  # the DSL on the path before the kernel module imports it

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, const_expr  # noqa: E402

from tilenorm.kernels import cute_row_norm_fp8  # noqa: E402
from tilenorm.kernels.cute_row_norm_fp8 import RowNormFp8Forward  # noqa: E402


class ClampedQuantize(RowNormFp8Forward):
    """The kernel with the clamp 7d44bfc dropped: each fp32 q value clamped to
    [-fp8_max, fp8_max] (NaN passing) before the conversion, as 7d44bfc's parent did, in
    ``_quantize`` (row, delayed) and each rep's quantization (block, MX). The conversion
    saturates by itself (``cvt.rn.satfinite``), so the bits are the shipped kernel's at two
    FMNMX more an element; yet row and MX at 4096 and 8192 columns ran 4-7% slower on an
    H200 after 7d44bfc (#117, #122). Timed beside the shipped kernel in one process, it
    says whether the clamp itself moves the bandwidth. Column amaxes (row+t) keep the
    shipped, unclamped form."""

    @cute.jit
    def _saturated(self, v: Float32) -> Float32:
        """``v`` clamped to [-fp8_max, fp8_max]; NaN passes through."""
        if v > Float32(self.fp8_max):
            v = Float32(self.fp8_max)
        if v < Float32(-self.fp8_max):
            v = Float32(-self.fp8_max)
        return v

    @cute.jit
    def _quantize(self, t: cute.Tensor, q: cute.Tensor, rstd: Float32, scale: Float32, i: int):
        """q[i] = saturate(t[i] * rstd * scale) in fp32; NaN passes through."""
        q[i] = self._saturated(t[i] * rstd * scale)

    @cute.jit
    def _quantize_rep(self, t: cute.Tensor, y: cute.Tensor, q_row: cute.Tensor, rstd: Float32,
                      scale: Float32, r: int):
        """The shipped ``_quantize_rep`` with each value saturated."""
        if const_expr(self.recompute_t):
            y_r = cute.make_rmem_tensor((self.vec,), Float32)
            for e in cutlass.range_constexpr(self.vec):
                y_r[e] = self._saturated(t[e, r] * rstd * scale)
            q_r = cute.make_rmem_tensor((self.vec,), self.fp8_dtype)
            q_r.store(y_r.load().to(self.fp8_dtype))
            cute.autovec_copy(cute.recast_tensor(q_r, cutlass.Uint8), q_row[None, r])
        else:
            for e in cutlass.range_constexpr(self.vec):
                y[e, r] = self._saturated(t[e, r] * rstd * scale)


#: Name -> kernel class, for ``cute_fp8_probe.py --variant`` and ``fp8_block_sass.py``.
VARIANTS: dict[str, type] = {"clamp": ClampedQuantize}


def compile_variant(name: str, key: _launch.Fp8ForwardKey, arch: str | None = None, **kwargs):
    """``compile_fp8_forward(key, arch, **kwargs)`` (tilenorm/launch/cute.py) with variant
    ``name``'s class in the kernel's place: that function takes the class from its module at
    each call, so the class is swapped there for the compile (tilenorm/ keeps no hook for
    experiments). Never cached: the ops' caches hold the shipped kernel under ``key``."""
    with mock.patch.object(cute_row_norm_fp8, "RowNormFp8Forward", VARIANTS[name]):
        return _launch.compile_fp8_forward(key, arch, **kwargs)

