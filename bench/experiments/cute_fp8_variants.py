"""Variants of the CuTe DSL FP8-output row kernel under measurement (not what the ops run):
subclasses of :class:`tilenorm.kernels.cute_row_norm_fp8.RowNormFp8Forward` that
``cute_fp8_probe.py --variant NAME`` compiles and times beside it (bench/NOTES.md #58). The
recompute-t variant (#74, #78) is the kernel's own ``recompute_t`` flag (``--variant
recompute-t``)."""

from __future__ import annotations

from tilenorm.launch import cute as launch_cute

launch_cute.available()  # puts the DSL's package folder on sys.path

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, const_expr  # noqa: E402

from tilenorm.kernels.cute_row_norm_fp8 import RowNormFp8Forward  # noqa: E402


class LeanBlockScales(RowNormFp8Forward):
    """Block scaling with two IEEE divisions a row per lane instead of two per rep: lane
    ``g`` of a block's lane group computes the scale of rep ``g`` (every lane of the group
    knows every rep's amax after the butterflies), stores its ``scale_inv`` and hands the
    scale to the group by shuffles. The shipped kernel divides on every lane for every rep:
    32 division calls with their convergence barriers in the 4096-column kernel's SASS
    against none in the MX kernel's (#58). Same results bit for bit: the same quotient of
    the same amax."""

    @cute.jit
    def _quantize_blocks(self, t, y, q, q_bytes, rstd, row, tidx, lane, bits, mQ, mQScale):
        if const_expr(self.scaling == "mx" or self.reps > self.block_lanes):
            super()._quantize_blocks(t, y, q, q_bytes, rstd, row, tidx, lane, bits, mQ,
                                     mQScale)
        else:
            g = lane % self.block_lanes
            mine = Float32(0.0)
            for r in cutlass.range_constexpr(self.reps):
                m = Float32(0.0)
                for e in cutlass.range_constexpr(self.vec):
                    m = cute.arch.fmax(m, cute.math.absf(t[e, r]))
                m = cute.arch.warp_reduction(m, cute.arch.fmax,
                                             threads_in_group=self.block_lanes)
                if g == r:
                    mine = m * rstd
            scale_mine = self._scale_of(mine)
            if g < self.reps:
                mQScale[row, (tidx - g + g * self.threads) // self.block_lanes] = (
                    Float32(1.0) / scale_mine)
            for r in cutlass.range_constexpr(self.reps):
                scale = cute.arch.shuffle_sync(scale_mine, lane - g + r)
                for e in cutlass.range_constexpr(self.vec):  # (vec, reps) is column-major
                    self._quantize(t, y, rstd, scale, e + r * self.vec)
            q.store(y.load().to(self.fp8_dtype))
            cute.autovec_copy(q_bytes, self._thread_view(mQ[row, None], tidx))


VARIANTS = {"lean-blocks": LeanBlockScales}
