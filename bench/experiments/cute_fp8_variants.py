"""Variants of the CuTe DSL FP8-output row kernel under measurement (not what the ops run):
subclasses of :class:`tilenorm.kernels.cute_row_norm_fp8.RowNormFp8Forward` that
``cute_fp8_probe.py --variant NAME`` compiles and times beside it (bench/NOTES.md #58)."""

from __future__ import annotations

import operator

from tilenorm.launch import cute as launch_cute

launch_cute.available()  # puts the DSL's package folder on sys.path

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, const_expr  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cutlass_dsl import T, dsl_user_op  # noqa: E402

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


@dsl_user_op
def _widen_half(word: Int32, zero: Int32, high: bool, bf16: bool, *, loc=None,
                ip=None) -> Float32:
    """fp32 of the low or high 16-bit half of ``word`` (bf16 or fp16 bits), exactly the
    DSL's widening, in an inline asm with side effects that also reads ``zero`` (0 at run
    time, from shared memory): LLVM can neither merge it with the same widening elsewhere
    nor hoist it out of the row loop, and ptxas cannot move it above the load of ``zero``
    (after the row's barrier): what lives across the barrier is the packed word. bf16 is a
    byte permute (``prmt``) that takes its zero bytes from ``zero``."""
    if bf16:
        asm = f"prmt.b32 $0, $1, $2, {0x3244 if high else 0x1044};"
    else:
        half = "{_, h}" if high else "{h, _}"
        asm = (f"{{ .reg .b16 h; .reg .b32 u; or.b32 u, $1, $2; mov.b32 {half}, u; "
               f"cvt.f32.f16 $0, h; }}")
    return Float32(llvm.inline_asm(
        T.f32(), [Int32(word).ir_value(loc=loc, ip=ip), Int32(zero).ir_value(loc=loc, ip=ip)],
        asm, "=f,r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


class RecomputeT(RowNormFp8Forward):
    """t = x * w recomputed where it is used instead of held in fp32 for the whole row
    (issue 19, 16384 columns): the shipped kernel keeps the weight in fp32 and stores t
    before the row's barrier, so each thread holds 2 x 4 bytes an element beside its ring of
    x; two CTAs of 256 threads an SM (128 registers a thread) then spill. Here the weight
    is read again from global memory / L1 at each use (``weight_source = "global"``) or
    stays in registers in its own dtype (``"registers"``, loaded once:
    :class:`RecomputeTPackedWeight`), and t is computed from the ring's
    x (still in its slot until the next row's load) once before the barrier for the row's
    max|t| (row, delayed, amax scalings only) and once after it for the quantization.

    Left to itself the compiler undoes this: LLVM merges the two widenings of x (and of a
    register weight) into one whose fp32 result lives across the barrier and hoists a
    register weight's widening out of the row loop; ptxas moves the second widening of x
    above the barrier. So every widening but the first of x goes through
    :func:`_widen_half`, an asm that reads a 0 from shared memory after the barrier
    (``zeros``, written once before the loop). Block and MX scales store each rep's q as
    soon as it is quantized (:meth:`_quantize_blocks`).

    sm_90a, 16384 columns, registers / spill stores (``cute_fp8_probe.py --compile-only``):
    (256, 2, 2) row 128/0, block 128/0, mx 128/0 (shipped 128/28, 128/32, 128/21); (512, 4, 1)
    as the shipped kernel, block without its 3 spills. (256, 4, 2) and (256, 4, 3) still
    spill: their ring alone is 4 x 64 bf16 = 128 registers a thread.

    Same fp32 operations in the same order as the shipped kernel (widening a 16-bit float
    is exact either way), so the same results bit for bit (the Gemma offset's
    ``x * w + x * offset`` as well, unless the compiler contracts it into an FMA
    differently in the two kernels). It costs more instructions: x * w twice a row (row,
    delayed), and 16 bytes of w read from L1 per 8 elements once (block, mx) or twice."""

    weight_source = "global"

    @cute.jit
    def _widen(self, src, dst, zero):
        """dst (fp32) = src (2-byte floats, (vec, reps)) through :func:`_widen_half`."""
        words = cute.recast_tensor(src, Int32)
        bf16 = const_expr(src.element_type == cutlass.BFloat16)
        for j in cutlass.range_constexpr(cute.size(words)):
            dst[2 * j] = _widen_half(words[j], zero, False, bf16)
            dst[2 * j + 1] = _widen_half(words[j], zero, True, bf16)

    @cute.jit
    def _t_of(self, x_in, mW, w_in, t, tidx, offset, zero, opaque: cutlass.Constexpr):
        """t = x * w (+ x * offset) in fp32 into ``t``, from the ring slot ``x_in``: the
        shipped kernel's operations. ``opaque`` widens x through :func:`_widen_half`; a
        2-byte weight always is (a weight of 4-byte floats is used as it is)."""
        if const_expr(opaque):
            self._widen(x_in, t, zero)
            x = t.load()
        else:
            x = x_in.load().to(Float32)
        if const_expr(self.has_weight):
            if const_expr(self.weight_source == "global"):
                cute.autovec_copy(self._thread_view(mW, tidx), w_in)
            if const_expr(self.weight_dtype.width == 16):
                w = cute.make_rmem_tensor(t.shape, Float32)
                self._widen(w_in, w, zero)
                wf = w.load()
            else:
                wf = w_in.load().to(Float32)
            tw = x * wf
            if const_expr(self.has_offset):
                tw = tw + x * offset
            t.store(tw)
        else:
            t.store(x)

    @cute.jit
    def _quantize_blocks(self, t, y, q, q_bytes, rstd, row, tidx, lane, bits, mQ, mQScale):
        """The shipped kernel's block and MX quantization, with each rep's 8 bytes of q
        converted and stored as soon as the rep is quantized rather than the row's at the
        end: the same values, two registers of q live instead of ``2 * reps``."""
        q_row = self._thread_view(mQ[row, None], tidx)
        for r in cutlass.range_constexpr(self.reps):
            m = Float32(0.0)
            for e in cutlass.range_constexpr(self.vec):
                m = cute.arch.fmax(m, cute.math.absf(t[e, r]))
            m = cute.arch.warp_reduction(m, cute.arch.fmax, threads_in_group=self.block_lanes)
            amax = m * rstd
            block = (tidx + r * self.threads) // self.block_lanes
            if const_expr(self.scaling == "mx"):
                k = self._mx_exponent(amax, bits)
                scale = self._power_of_two(-k, bits)
                if lane % self.block_lanes == 0:
                    mQScale[row, block] = cutlass.Uint8(k + 127)
            else:
                scale = self._scale_of(amax)
                if lane % self.block_lanes == 0:
                    mQScale[row, block] = Float32(1.0) / scale
            y_r = cute.make_rmem_tensor((self.vec,), Float32)
            for e in cutlass.range_constexpr(self.vec):
                v = t[e, r] * rstd * scale
                if v > Float32(self.fp8_max):
                    v = Float32(self.fp8_max)
                if v < Float32(-self.fp8_max):
                    v = Float32(-self.fp8_max)
                y_r[e] = v
            q_r = cute.make_rmem_tensor((self.vec,), self.fp8_dtype)
            q_r.store(y_r.load().to(self.fp8_dtype))
            cute.autovec_copy(cute.recast_tensor(q_r, cutlass.Uint8), q_row[None, r])

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor | None, mScale: cute.Tensor | None,
               mQ: cute.Tensor | None, mQScale: cute.Tensor | None, mRstd: cute.Tensor,
               mAmax: cute.Tensor | None, eps: Float32, offset: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        program, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        rows = mX.shape[0]
        last = rows - 1
        inv_n = Float32(1.0 / self.cols)
        per_thread = self.vec * self.reps
        row_amax = const_expr(self.scaling in ("amax", "delayed", "row"))

        smem = cutlass.memory.SmemAllocator()
        sums = smem.allocate_tensor(Float32, cute.make_layout((self.warps, 2, 2)), 16)
        # A 0 the compiler cannot see (_widen_half), read after each row's barrier.
        zeros = smem.allocate_tensor(Int32, cute.make_layout((1,)), 4)
        if tidx == 0:
            zeros[0] = Int32(0)
        cute.arch.barrier()

        shape = (self.vec, self.reps)
        w_in = None
        if const_expr(self.has_weight):
            w_in = cute.make_rmem_tensor(shape, self.weight_dtype)
            if const_expr(self.weight_source == "registers"):
                cute.autovec_copy(self._thread_view(mW, tidx), w_in)
        t = cute.make_rmem_tensor(shape, Float32)
        y = cute.make_rmem_tensor(shape, Float32)
        q = cute.make_rmem_tensor(shape, self.fp8_dtype)
        q_bytes = cute.recast_tensor(q, cutlass.Uint8)
        xs = [cute.make_rmem_tensor(shape, self.dtype) for _ in range(self.stages)]
        bits = cute.make_rmem_tensor((2,), Float32)
        acc = cute.make_rmem_tensor((1,), Float32)
        acc[0] = Float32(0.0)
        given = Float32(1.0)
        if const_expr(self.scaling == "delayed"):
            given = mScale[0]

        for s in cutlass.range_constexpr(self.stages - 1):
            cute.autovec_copy(
                self._thread_view(mX[cutlass.min(program + s * grid, last), None], tidx),
                xs[s])

        for base in cutlass.range(program, rows, self.stages * grid):
            for s in cutlass.range_constexpr(self.stages):
                ahead = (s + self.stages - 1) % self.stages
                cute.autovec_copy(
                    self._thread_view(
                        mX[cutlass.min(base + (s + self.stages - 1) * grid, last), None],
                        tidx),
                    xs[ahead])
                row = base + s * grid
                if row < rows:
                    x = xs[s].load().to(Float32)
                    sq = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    part_sq = cute.arch.warp_reduction(sq, operator.add)
                    part_max = Float32(0.0)
                    if const_expr(row_amax):
                        self._t_of(xs[s], mW, w_in, t, tidx, offset, zeros[0], False)
                        m = Float32(0.0)
                        for i in cutlass.range_constexpr(per_thread):
                            m = cute.arch.fmax(m, cute.math.absf(t[i]))
                        part_max = cute.arch.warp_reduction(m, cute.arch.fmax)
                    parity = s % 2
                    if lane == 0:
                        sums[warp, 0, parity] = part_sq
                        sums[warp, 1, parity] = part_max
                    cute.arch.barrier()
                    total = Float32(0.0)
                    tmax = Float32(0.0)
                    for i in cutlass.range_constexpr(self.warps):
                        total = total + sums[i, 0, parity]
                        if const_expr(row_amax):
                            tmax = cute.arch.fmax(tmax, sums[i, 1, parity])
                    rstd = cute.math.rsqrt(total * inv_n + eps)
                    if tidx == 0:
                        mRstd[row] = rstd
                    if const_expr(self.scaling != "amax"):
                        self._t_of(xs[s], mW, w_in, t, tidx, offset, zeros[0], True)
                    if const_expr(row_amax):
                        amax = tmax * rstd
                        if const_expr(self.scaling == "row"):
                            scale = self._scale_of(amax)
                            for i in cutlass.range_constexpr(per_thread):
                                self._quantize(t, y, rstd, scale, i)
                            q.store(y.load().to(self.fp8_dtype))
                            cute.autovec_copy(q_bytes, self._thread_view(mQ[row, None], tidx))
                            if tidx == 0:
                                mQScale[row, 0] = Float32(1.0) / scale
                        else:
                            acc[0] = cute.arch.fmax(acc[0], amax)
                            if const_expr(self.scaling == "delayed"):
                                for i in cutlass.range_constexpr(per_thread):
                                    self._quantize(t, y, rstd, given, i)
                                q.store(y.load().to(self.fp8_dtype))
                                cute.autovec_copy(q_bytes,
                                                  self._thread_view(mQ[row, None], tidx))
                    else:
                        self._quantize_blocks(t, y, q, q_bytes, rstd, row, tidx, lane, bits,
                                              mQ, mQScale)
        if const_expr(self.scaling in ("amax", "delayed")):  # noqa: SIM102
            if tidx == 0:
                mAmax[program] = acc[0]


class RecomputeTPackedWeight(RecomputeT):
    """:class:`RecomputeT` with the weight loaded once and kept in registers in its own
    dtype (2 bytes an element), widened at each use. At (256, 2, 2) and 16384 columns its
    32 registers of w beside the 64 of the ring leave too few: row 128/31 spill stores,
    block 128/10, mx 128/0 (sm_90a)."""

    weight_source = "registers"


VARIANTS = {"lean-blocks": LeanBlockScales, "recompute-t": RecomputeT,
            "recompute-t-packed-w": RecomputeTPackedWeight}
