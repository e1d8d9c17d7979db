"""RMSNorm forward with FP8 output in the CuTe DSL, with the next rows' loads in flight while
a row is reduced and quantized.

The cuTile FP8 row kernel (tilenorm/kernels/cutile_row_norm_fp8.py) loads a row, reduces it,
quantizes it, and only then loads the next: a cuTile persistent loop cannot carry a loaded
tile (bench/NOTES.md #8, #22). On an H200 that holds it to ~73% of copy bandwidth at 4096
columns, whichever launch hints (#56). Here, as in the CuTe backward
(cute_row_norm_backward.py), each thread keeps ``stages`` rows of its 16-byte vectors in
registers: the loads of row ``r + (stages - 1) * grid`` are issued before row ``r`` is
reduced.

The math is the cuTile kernel's, fp32 throughout, with the weight applied before the
row's scalar::

    t = x * w (+ x * offset)        y = t * rstd        rstd = 1 / sqrt(mean(x^2) + eps)

Rounding is monotonic and ``rstd > 0``, so the largest ``|y|`` of any set of elements is
exactly ``max|t| * rstd`` rounded once: the row's sum of squares and its ``max|t|`` (or its
blocks') go through one reduction together, and every scale is an exact function of the
amax of the stored y, as in the cuTile kernel (``_scale_of``, ``_mx_exponent``). Every
amax skips NaN (``fmax`` returns the number), so a NaN stays in its row or block. FP8 x's
row ``max|t|`` is folded from +0 and its warp and cross-warp maxima are taken on the bits as
unsigned integers (``redux.sync.max.u32``, one instruction each: for +0, positive numbers
and +inf, unsigned order is float order); where every ``|t|`` of a row is NaN it is then +0
(NaN read as 0, as cuTile's ``_abs_skipping_nan``) where 2-byte x's fold ends with NaN, and
``amax = max|t| * rstd`` is 0, or NaN where rstd is not finite, rather than NaN: either way
the scale is 1 and delayed's and amax's running maximum stays as it was, so the outputs are
the same bits (emulated for NaN, infinities, subnormals and NaN / infinite rstd on the CPU,
tests/test_fp8.py).
Saturation is the conversion's own: PTX converts fp32 to FP8 only with ``.satfinite``
(``cvt.rn.satfinite.e4m3x2.f32``, F2FP.SATFINITE in the SASS, asserted by
tests/test_fp8.py), which clamps what lies beyond the format's largest finite value, an
infinity too, to it and keeps NaN. ``clamp`` clamps each value to ``[-fp8_max, fp8_max]``
before it all the same (``_saturated``): the same bits at two ``FMNMX.NAN`` an element,
which yet ran row scaling at 4096 and 8192 columns and MX at 2048 and 8192 2-4.5% faster on
an H200, and row scaling at 2048 2-3% slower (bench/NOTES.md #117, #125; where it runs:
settings_fp8.py's ``cute_forward_clamp``).

Scalings (``scaling``): ``"row"`` (q and one fp32 ``scale_inv`` a row, (rows, 1)),
``"block"`` (one per 128 columns, (rows, cols / 128) with strides (1, rows)), ``"mx"``
(E8M0 bytes of 1 x 32 blocks, (rows, cols / 32) row-major), ``"delayed"`` (q with the given
scale, and this program's amax), ``"amax"`` (no q: rstd and the program's amax, pass 1 of
the per-tensor current scaling, whose pass 2 is cuTile's ``fp8_quantize_normed``).
``column_amax`` ("row", 2-byte x): also each column's largest ``|t * rstd|`` (y as q takes it)
over the program's rows, row ``p`` of the (grid, cols) fp32 ``amax`` operand, for the
per-column scales of the transposed copy (cute_fp8_transpose.py with ``weight_first``, after
cuTile's ``fp8_column_amax``); kept in shared memory, each thread its own columns.

Layout: program ``p`` of ``grid`` takes rows ``p, p + grid, ...``; ``threads`` threads each
hold ``reps`` 16-byte vectors of a row, ``threads`` vectors apart, so every load is
coalesced and a 128-column block is 16 consecutive lanes (a 32-column MX block 4): block
amaxes are lane butterflies, the row's go through shared memory in warp order (one barrier a
row, slots by parity). Deterministic: fixed reduction trees, no atomics.

FP8 x (``group`` > 0, ``dtype`` its FP8 format; x arrives as its bytes): a 16-byte vector is
16 elements, and ``x_scale_inv`` holds one fp32 multiplier per ``group`` consecutive elements
of a row, a group whole vectors (16 or more elements), so each vector takes one multiplier:
the ring holds a row's bytes and the multiplier of each of the thread's vectors, loaded
together. x = widen(fp8) * multiplier, one fp32 rounding, as cutile_row_norm_fp8.py's
``_dequantized``; from there the math is the same. A 128-column block is 8 lanes, an MX
block 2.

``shared_ring`` (not with ``recompute_t``): the ring of x (and FP8 x's multipliers) in
shared memory, filled by ``cp.async`` (16 and 4 bytes; each thread its own vectors and its
own copy of their multipliers, so ``cp.async.wait_group`` alone orders a slot's copies
before its reads: no barrier). A row is read from its slot and the slot refilled with the
row ``stages`` turns on once the row is done: ``stages - 1`` rows in flight while one is
reduced, as in the register ring, but no load of the loop sets a register scoreboard. The
register ring's loads share one, so the first use of each trip's last row waits for the
row just issued, a memory latency a trip (bench/NOTES.md #132). The same values in the
same order, so the same bits.

``recompute_t``: the weight and t are not held across the row. The kernel above keeps the
weight in fp32 and t beside the ring of x, 2 x 4 bytes an element; two CTAs of 256 threads an
SM at 16384 columns (128 registers a thread) then spill. With ``recompute_t`` each use reads
the weight again (from L1) and computes t = x * w from the x still in its ring slot (the
slot is refilled only when the next row's turn begins): once before the barrier for the row's
max|t| (row, delayed, amax), once after it for the quantization; block and MX scalings store
each rep's q as soon as it is quantized, and so does row scaling keeping column amaxes
(``column_amax``), which after the barrier recomputes t a rep at a time beside the rep's
column maxima: on sm_90a at 16384 columns, (256, 2, 2), bf16 x, no spills without the offset
(the row's t recomputed at once before them: 42-51 spill stores; bench/NOTES.md #125).
Without the Gemma offset these are the same fp32 operations on the same values (widening a
2-byte float is exact), so the same results bit for bit; with it the compiler contracts
x * w + x * offset differently in the two kernels and the bits differ (every scaling, an H100
at b2d144f, #78), each within the float64 tests' tolerance (the offset's t a rep at a time
beside the column maxima is not yet compared with the row's on a GPU). More instructions: t
twice a row (row, delayed), and the weight read again from L1 once a row (block, mx) or
twice. Where it runs: settings_fp8.py's ``cute_forward_recompute_t`` (#74, #78).
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from tilenorm.kernels.cute_rows import SMEM_CARVEOUT, RowKernel, ring_copies

#: Scalings the kernel takes; ``BLOCK_COLS`` the columns one scale of a block scaling covers.
SCALINGS = ("amax", "delayed", "row", "block", "mx")
BLOCK_COLS = {"block": 128, "mx": 32}
#: The largest finite fp32: a scale that would overflow is clamped to it.
FLOAT32_MAX = 3.4028234663852886e38


def _power_of_two(n: int) -> bool:
    return n > 0 and not n & (n - 1)


@dsl_user_op
def _widen_half(word: Int32, zero: Int32, high: bool, bf16: bool, *, loc=None,
                ip=None) -> Float32:
    """fp32 of the low or high 16-bit half of ``word`` (bf16 or fp16 bits), exactly the
    DSL's widening, in an inline asm with side effects that also reads ``zero`` (0 at run
    time, from shared memory). ``recompute_t`` widens through it: left to itself LLVM merges
    the two widenings of x (and of the weight) into one whose fp32 result lives across the
    row's barrier and hoists the weight's out of the row loop, and ptxas moves the second
    widening of x above the barrier. Neither can merge or hoist this asm, nor move it above
    the load of ``zero`` (after the barrier): what lives across the barrier is the packed
    word. bf16 is a byte permute (``prmt``) that takes its zero bytes from ``zero``."""
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


@dsl_user_op
def _warp_max(value: Float32, *, loc=None, ip=None) -> Float32:
    """The largest ``value`` of the warp, for values that are each +0, a positive number or
    +inf (no NaN, no sign bit): one ``redux.sync.max.u32`` of their bits, whose unsigned
    order is the floats' order there (sm_90 has no fp32 ``redux``); every lane gets it."""
    bits = cutlass.Uint32(llvm.bitcast(T.i32(), Float32(value).ir_value(loc=loc, ip=ip),
                                       loc=loc, ip=ip))
    top = cute.arch.warp_redux_sync(bits, "umax", loc=loc, ip=ip)
    return Float32(llvm.bitcast(T.f32(), top.ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


class Fp8Scales:
    """The scale arithmetic of the CuTe FP8 kernels (this row kernel and the transposed
    copy's, cute_fp8_transpose.py), exactly cutile_row_norm_fp8.py's; ``fp8_max`` is the
    format's largest finite value."""

    fp8_max: float

    @cute.jit
    def _scale_of(self, amax: Float32) -> Float32:
        """``fp8_max / amax`` (IEEE division); 1 where amax is 0 or not finite, clamped to
        the largest fp32 where it would overflow: cutile_row_norm_fp8.py's ``_scale_of``."""
        scale = Float32(1.0)
        if amax > Float32(0.0) and amax <= Float32(FLOAT32_MAX):
            scale = cutlass.min(Float32(self.fp8_max) / amax, Float32(FLOAT32_MAX))
        return scale

    @cute.jit
    def _mx_exponent(self, amax: Float32, bits: cute.Tensor) -> Int32:
        """The smallest k with ``amax <= fp8_max * 2^k``, from the bits of both (exact: no
        division, no logarithm), clamped to E8M0's [-127, 127]; 0 for amax = 0:
        cutile_row_norm_fp8.py's ``_mx_exponent``."""
        bits[0] = amax
        bits[1] = Float32(self.fp8_max)
        ints = cute.recast_tensor(bits, Int32)
        a_bits = ints[0]
        m_bits = ints[1]
        k = ((a_bits >> 23) & 0xFF) - ((m_bits >> 23) & 0xFF)
        if (a_bits & 0x7FFFFF) > (m_bits & 0x7FFFFF):
            k = k + 1
        k = cutlass.min(cutlass.max(k, Int32(-127)), Int32(127))
        if not amax > Float32(0.0):
            k = Int32(0)
        return k

    @cute.jit
    def _power_of_two(self, k: Int32, bits: cute.Tensor) -> Float32:
        """2^k as fp32 for k in [-126, 127]: the exponent field's bits."""
        ints = cute.recast_tensor(bits, Int32)
        ints[0] = (k + 127) << 23
        return bits[0]


class RowNormFp8Forward(RowKernel, Fp8Scales):
    """The kernel for one (dtypes, width, scaling, launch config, ``recompute_t``,
    ``column_amax``, FP8 x's ``group``: 0 for x that is not FP8, ``clamp``, ``shared_ring``);
    ``__call__``
    launches it on ``grid`` programs (``mXScale`` None but for FP8 x)."""

    def __init__(self, dtype, weight_dtype, fp8_dtype, fp8_max: float, cols: int,
                 threads: int, stages: int, ctas_per_sm: int, scaling: str,
                 has_offset: bool, recompute_t: bool = False, column_amax: bool = False,
                 group: int = 0, clamp: bool = False, shared_ring: bool = False):
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
        self.dtype = dtype
        self.weight_dtype = weight_dtype
        self.fp8_dtype = fp8_dtype
        self.fp8_max = fp8_max
        self.cols = cols
        self.threads = threads
        self.vec = 128 // dtype.width
        self.reps = self._whole_vectors(cols)
        self.block_lanes = BLOCK_COLS.get(scaling, self.vec) // self.vec
        if self.block_lanes < 1 or threads % max(self.block_lanes, 1):
            raise ValueError(f"{scaling} blocks are not whole vectors of a thread group")
        if stages < 2 or stages % 2:
            # Consecutive rows reduce in two shared-memory slots by their place in the ring:
            # an odd ring puts its last row and the next ring's first in one slot.
            raise ValueError(f"stages must be even and >= 2, got {stages}")
        if recompute_t and dtype.width != 16:
            raise ValueError("recompute_t widens x from its 16-bit words: 2-byte x only")
        if column_amax and scaling != "row":
            raise ValueError("column amaxes are kept for a per-row scaling's transposed copy")
        if (group != 0) != (dtype.width == 8) or group % self.vec:
            raise ValueError(f"FP8 x takes a group of whole {self.vec}-element vectors (and "
                             f"only FP8 x one): got {group} for {dtype}")
        if column_amax and group:
            # Their one reader, the CuTe copy with weight_first (cute_fp8_transpose.py),
            # reads 2-byte x: FP8 x's row-scaled copy keeps cuTile's kernels (dispatch).
            raise ValueError("column amaxes are kept for the CuTe copy of 2-byte x only")
        if shared_ring and (recompute_t or group and (scaling == "block"
                                                      or threads % (group // self.vec))):
            # recompute_t widens x again from its register slot after the barrier; FP8 x's
            # multipliers are copied from per-thread bases (_thread_bases), a fixed stride
            # apart.
            raise ValueError("the ring in shared memory takes neither recompute_t nor, for "
                             "FP8 x, block scaling or multipliers of uneven stride")
        self.stages = stages
        self.ctas_per_sm = ctas_per_sm
        self.scaling = scaling
        self.has_weight = weight_dtype is not None
        self.has_offset = has_offset
        self.recompute_t = recompute_t
        self.column_amax = column_amax
        self.group = group
        self.clamp = clamp
        self.shared_ring = shared_ring
        self.warps = threads // cute.arch.WARP_SIZE
        # The reduce-scatter of a block's amaxes (_scattered_block_amax): where the reps and
        # the block's lanes are powers of two, no more reps than lanes.
        self.scatter = (scaling in BLOCK_COLS and _power_of_two(self.reps)
                        and _power_of_two(self.block_lanes) and self.reps <= self.block_lanes)
        # FP8 x's loop (bench/NOTES.md #124): the fp32 weight in shared memory, read each
        # row, where the registers of a deep ring would otherwise widen the 2-byte weight
        # again for every row (MX scaling spills with it), laid out by :meth:`_spread` (a
        # thread's own 64 contiguous bytes cost 19-24% of the H200's FP8-x time, #127,
        # #128); per-thread 64-bit addresses of x, the multipliers and q
        # held across the loop (block scaling spills with them).
        self.smem_weight = bool(group) and self.has_weight and scaling != "mx"
        self.thread_bases = bool(group) and scaling != "block"

    @cute.jit
    def __call__(self, mX: cute.Tensor, mXScale: cute.Tensor | None, mW: cute.Tensor | None,
                 mScale: cute.Tensor | None, mQ: cute.Tensor | None,
                 mQScale: cute.Tensor | None, mRstd: cute.Tensor, mAmax: cute.Tensor | None,
                 eps: Float32, offset: Float32, grid: Int32, stream):
        self.kernel(mX, mXScale, mW, mScale, mQ, mQScale, mRstd, mAmax, eps, offset).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream,
            max_number_threads=[self.threads, 1, 1], min_blocks_per_mp=self.ctas_per_sm,
            preferred_smem_carveout=SMEM_CARVEOUT)

    @cute.jit
    def _saturated(self, v: Float32) -> Float32:
        """``v`` as the conversion to FP8 takes it: with ``clamp`` clamped to [-fp8_max,
        fp8_max], else ``v`` (the conversion saturates by itself). A NaN fails both
        comparisons and passes, as the conversion keeps it: the compiler makes each
        comparison and select a NaN-propagating minimum or maximum (``FMNMX.NAN``;
        tests/test_fp8.py asserts them, and no plain ``FMNMX``, which would return
        +-fp8_max for a NaN)."""
        if const_expr(self.clamp):
            if v > Float32(self.fp8_max):
                v = Float32(self.fp8_max)
            if v < Float32(-self.fp8_max):
                v = Float32(-self.fp8_max)
        return v

    @cute.jit
    def _quantize(self, t: cute.Tensor, q: cute.Tensor, rstd: Float32, scale: Float32, i: int):
        """The fp32 value of q[i]: t[i] * rstd * scale, :meth:`_saturated`."""
        q[i] = self._saturated(t[i] * rstd * scale)

    @cute.jit
    def _widen(self, src: cute.Tensor, dst: cute.Tensor, zero: Int32):
        """dst (fp32) = src (2-byte floats, (vec, reps)) through :func:`_widen_half`."""
        words = cute.recast_tensor(src, Int32)
        bf16 = const_expr(src.element_type == cutlass.BFloat16)
        for j in cutlass.range_constexpr(cute.size(words)):
            dst[2 * j] = _widen_half(words[j], zero, False, bf16)
            dst[2 * j + 1] = _widen_half(words[j], zero, True, bf16)

    @cute.jit
    def _store_t(self, x, w: cute.Tensor | None, t: cute.Tensor, offset: Float32):
        """t = x * w (+ x * offset): fp32 x of the row and its fp32 weight (None without
        one)."""
        if const_expr(self.smem_weight):
            # Shared memory's 16-byte chunks (:meth:`_chunked`) into a (vec, reps) register
            # tensor, in the order of x's elements.
            w_regs = cute.make_rmem_tensor(t.shape, Float32)
            cute.autovec_copy(w, self._chunked(w_regs.iterator, 4, self.vec))
            w = w_regs
        if const_expr(self.has_weight and self.has_offset and self.smem_weight):
            # fma(x, w, x * offset), the contraction the compiler makes of the sum below
            # with the weight in registers; with it read from shared memory the compiler
            # fuses x * offset instead, which rounds differently.
            t.store(cute.math.fma(x, w.load(), x * offset))
        elif const_expr(self.has_weight):
            tw = x * w.load()
            if const_expr(self.has_offset):
                tw = tw + x * offset
            t.store(tw)
        else:
            t.store(x)

    @cute.jit
    def _recompute_t(self, x_in: cute.Tensor, mW: cute.Tensor | None, w_in, t: cute.Tensor,
                     tidx: Int32, offset: Float32, zero: Int32, opaque: cutlass.Constexpr,
                     r: cutlass.Constexpr = None):
        """``recompute_t``'s t, into ``t``, from the ring slot ``x_in`` and the weight read
        again into ``w_in``: ``opaque`` widens x through :func:`_widen_half` (after the
        barrier); a 2-byte weight always is (a weight of 4-byte floats is used as it is).
        ``r``: rep ``r``'s vector only."""
        w_view = self._thread_view(mW, tidx) if const_expr(self.has_weight) else None
        if const_expr(r is not None):
            x_in, t = x_in[None, r], t[None, r]
            if const_expr(self.has_weight):
                w_in, w_view = w_in[None, r], w_view[None, r]
        if const_expr(opaque):
            self._widen(x_in, t, zero)
            x = t.load()
        else:
            x = x_in.load().to(Float32)
        w = None
        if const_expr(self.has_weight):
            cute.autovec_copy(w_view, w_in)
            w = w_in
            if const_expr(self.weight_dtype.width == 16):
                w = cute.make_rmem_tensor(t.shape, Float32)
                self._widen(w_in, w, zero)
        self._store_t(x, w, t, offset)

    @cute.jit
    def _thread_bases(self, mX: cute.Tensor, mXScale: cute.Tensor | None,
                      mQ: cute.Tensor | None, tidx: Int32) -> tuple:
        """(x, multipliers, q): where ``thread_bases``, the address of this thread's first
        element of row 0 of each (None where absent, and the multipliers' where a thread's
        groups are not a fixed stride apart), so a row's address is one 64-bit multiply-add
        rather than the row's and the thread's offsets combined again for every row."""
        x_base = s_base = q_base = None
        if const_expr(self.thread_bases):
            first = cute.assume(tidx * self.vec, divby=self.vec)
            x_base = mX.iterator + first
            if const_expr(mQ is not None):
                q_base = mQ.iterator + first
            per_group = self.group // self.vec
            if const_expr(self.threads % per_group == 0):
                s_base = mXScale.iterator + tidx // per_group
        return x_base, s_base, q_base

    @cute.jit
    def _row_view(self, m: cute.Tensor, base, row: Int32, tidx: Int32) -> cute.Tensor:
        """This thread's (vec, reps) elements of row ``row`` of ``m``, from ``base``
        (:meth:`_thread_bases`) where given."""
        if const_expr(base is None):
            return self._thread_view(m[row, None], tidx)
        return self._from_thread(base + cute.assume(cutlass.Int64(row) * self.cols,
                                                    divby=self.cols))

    @cute.jit
    def _chunked(self, first, chunk_stride: int, rep_stride: int) -> cute.Tensor:
        """A thread's (vec, reps) fp32 values as ((4, vec / 4), reps) 4-element chunks:
        chunk ``c`` of rep ``r`` at ``first + chunk_stride * c + rep_stride * r``
        (:meth:`_spread`'s in shared memory; a register tensor's own: 4, vec)."""
        return cute.make_tensor(first, cute.make_layout(
            ((4, self.vec // 4), self.reps), stride=((1, chunk_stride), rep_stride)))

    @cute.jit
    def _spread(self, smem, tidx: Int32) -> cute.Tensor:
        """A row of fp32 values allocated in shared memory, this thread's (vec, reps) of
        them as :meth:`_chunked` chunks at 4 * tidx, strides 4 * threads and vec * threads:
        a warp's 16-byte accesses are 512 consecutive bytes, 4 wavefronts, where a thread's
        own contiguous vec * 4 bytes put 2 (2-byte x) or 4 (FP8 x) lanes on a bank
        (bench/NOTES.md #127, #128)."""
        return self._chunked(
            smem.allocate_tensor(Float32, cute.make_layout((self.cols,)), 16).iterator
            + cute.assume(tidx * 4, divby=4), 4 * self.threads, self.vec * self.threads)

    @cute.jit
    def _from_thread(self, first) -> cute.Tensor:
        """The (vec, reps) elements of a row whose thread's first element is at ``first``:
        :meth:`_thread_view`'s from its address."""
        return cute.make_tensor(first, cute.make_layout((self.vec, self.reps),
                                                        stride=(1, self.threads * self.vec)))

    @cute.jit
    def _load_row(self, mX: cute.Tensor, mXScale: cute.Tensor | None, row: Int32,
                  tidx: Int32, x_slot: cute.Tensor, scale_slot: cute.Tensor | None,
                  bases: tuple):
        """Issue the loads of this thread's vectors of ``row`` into its ring slot and, for
        FP8 x, the multiplier of each vector's group (one a vector: a group is whole
        vectors) into ``scale_slot`` (reps,); ``bases`` :meth:`_thread_bases`'s."""
        cute.autovec_copy(self._row_view(mX, bases[0], row, tidx), x_slot)
        if const_expr(self.group):
            per_group = self.group // self.vec
            if const_expr(bases[1] is not None):
                # The reps' groups threads // per_group apart from the thread's first.
                groups = cute.make_tensor(
                    bases[1] + cutlass.Int64(row) * (self.cols // self.group),
                    cute.make_layout((self.reps,), stride=(self.threads // per_group,)))
                for r in cutlass.range_constexpr(self.reps):
                    scale_slot[r] = groups[r]
            else:
                for r in cutlass.range_constexpr(self.reps):
                    if const_expr(self.threads % per_group == 0):
                        # (tidx + r * threads) // per_group, with the rep a constant term:
                        # the reps' loads share one address, at immediate offsets.
                        group = tidx // per_group + r * (self.threads // per_group)
                    else:
                        group = (tidx + r * self.threads) // per_group
                    scale_slot[r] = mXScale[row, group]

    @cute.jit
    def _stage_row(self, copies: tuple, mX: cute.Tensor, row: Int32, tidx: Int32,
                   slot: cute.Tensor, scale_slot: cute.Tensor, bases: tuple):
        """``shared_ring``: this thread's vectors of ``row`` and their multipliers into its
        shared-memory ``slot`` and ``scale_slot`` by ``cp.async`` (16 and 4 bytes), committed
        as one group (every call one, so that ``wait_group`` counts rows)."""
        cute.copy(copies[0], self._row_view(mX, bases[0], row, tidx), slot)
        if const_expr(self.group):
            # (1, reps): cute.copy takes mode 0 as one copy's values, so a (reps,) view
            # would stage the first rep's multiplier alone (bench/NOTES.md #133).
            per_group = self.group // self.vec
            groups = cute.make_tensor(
                bases[1] + cutlass.Int64(row) * (self.cols // self.group),
                cute.make_layout((1, self.reps), stride=(0, self.threads // per_group)))
            staged = cute.make_tensor(scale_slot.iterator, cute.make_layout(
                (1, self.reps), stride=(0, self.threads)))
            cute.copy(copies[1], groups, staged)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _values(self, x_slot: cute.Tensor, scale_slot: cute.Tensor | None,
                xf: cute.Tensor | None):
        """The fp32 x of a ring slot: widened (exact), and for FP8 x times its group's
        multiplier, one fp32 rounding, as cutile_row_norm_fp8.py's ``_dequantized``."""
        if const_expr(self.group):
            xf.store(cute.recast_tensor(x_slot, self.dtype).load().to(Float32))
            for r in cutlass.range_constexpr(self.reps):
                for e in cutlass.range_constexpr(self.vec):
                    xf[e, r] = xf[e, r] * scale_slot[r]
            x = xf.load()
        else:
            x = x_slot.load().to(Float32)
        return x

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mXScale: cute.Tensor | None, mW: cute.Tensor | None,
               mScale: cute.Tensor | None, mQ: cute.Tensor | None,
               mQScale: cute.Tensor | None, mRstd: cute.Tensor, mAmax: cute.Tensor | None,
               eps: Float32, offset: Float32):
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
        # (warp, sum of squares | max|t|, parity): two consecutive rows use different slots,
        # so one barrier a row orders every write before its reads and every read before
        # the slot's next write.
        sums = smem.allocate_tensor(Float32, cute.make_layout((self.warps, 2, 2)), 16)
        zeros = None
        if const_expr(self.recompute_t):
            # A 0 the compiler cannot see (_widen_half), read after each row's barrier.
            zeros = smem.allocate_tensor(Int32, cute.make_layout((1,)), 4)
            if tidx == 0:
                zeros[0] = Int32(0)
            cute.arch.barrier()
        # column_amax: each column's largest |y| over the program's rows, in shared memory
        # (registers hold the ring) laid out as :meth:`_spread` says; each thread keeps the
        # slots of its own columns, so no barrier orders them.
        columns = None
        if const_expr(self.column_amax):
            columns = self._spread(smem, tidx)
            for r in cutlass.range_constexpr(self.reps):
                for e in cutlass.range_constexpr(self.vec):
                    columns[e, r] = Float32(0.0)

        shape = (self.vec, self.reps)
        # The weight as loaded, and (but with recompute_t) in fp32 for every row: in
        # registers, or with smem_weight in shared memory, each thread its own columns (so
        # no barrier orders them), read again each row.
        w_in = w = None
        if const_expr(self.has_weight):
            w_in = cute.make_rmem_tensor(shape, self.weight_dtype)
            if const_expr(not self.recompute_t):
                cute.autovec_copy(self._thread_view(mW, tidx), w_in)
                w = cute.make_rmem_tensor(shape, Float32)
                w.store(w_in.load().to(Float32))
                if const_expr(self.smem_weight):
                    w_fp32 = w
                    w = self._spread(smem, tidx)
                    cute.autovec_copy(self._chunked(w_fp32.iterator, 4, self.vec), w)
        # shared_ring: (byte, slot), a thread's vectors of a slot where _thread_view puts them
        # in a row, so a warp's 16-byte copies and reads are 512 consecutive bytes.
        # Its multipliers: (thread + threads * rep, slot), each thread its own copy of its
        # vectors' multipliers, conflict-free.
        # The ring of x as loaded: FP8 x as its bytes (DLPack has no FP8 types everywhere:
        # mX is uint8), with a ring of its group multipliers and the fp32 x of a row.
        x_type = cutlass.Uint8 if const_expr(self.group) else self.dtype
        x_ring = scale_ring = copies = None
        if const_expr(self.shared_ring):
            x_ring = smem.allocate_tensor(x_type, cute.make_layout((self.cols, self.stages)),
                                          16)
            if const_expr(self.group):
                scale_ring = smem.allocate_tensor(
                    Float32, cute.make_layout((self.threads * self.reps, self.stages)), 16)
            copies = ring_copies(x_type)
        t = cute.make_rmem_tensor(shape, Float32)
        y = cute.make_rmem_tensor(shape, Float32)
        q = cute.make_rmem_tensor(shape, self.fp8_dtype)
        # q leaves as its bytes: DLPack has no FP8 types everywhere (mQ is uint8).
        q_bytes = cute.recast_tensor(q, cutlass.Uint8)
        ss = [None] * self.stages
        xf = s_held = None
        if const_expr(self.shared_ring):
            xs = [self._thread_view(x_ring[None, j], tidx) for j in range(self.stages)]
            x_held = cute.make_rmem_tensor(shape, x_type)
            if const_expr(self.group):
                ss = [cute.make_tensor(scale_ring[None, j].iterator + tidx,
                                       cute.make_layout((self.reps,), stride=(self.threads,)))
                      for j in range(self.stages)]
                s_held = cute.make_rmem_tensor((self.reps,), Float32)
                xf = cute.make_rmem_tensor(shape, Float32)
        else:
            xs = [cute.make_rmem_tensor(shape, x_type) for _ in range(self.stages)]
            if const_expr(self.group):
                ss = [cute.make_rmem_tensor((self.reps,), Float32) for _ in range(self.stages)]
                xf = cute.make_rmem_tensor(shape, Float32)
        bits = cute.make_rmem_tensor((2,), Float32)
        # The program's amax over its rows (delayed, amax), in a register tensor: a value
        # the next trip of the loop reads must be memory, not an SSA value of the body.
        acc = cute.make_rmem_tensor((1,), Float32)
        acc[0] = Float32(0.0)
        given = Float32(1.0)
        if const_expr(self.scaling == "delayed"):
            given = mScale[0]

        bases = self._thread_bases(mX, mXScale, mQ, tidx)
        # Rows past the end are clamped to the last row: loaded, never used.
        if const_expr(self.shared_ring):
            for s in cutlass.range_constexpr(self.stages):
                self._stage_row(copies, mX, cutlass.min(program + s * grid, last), tidx,
                                xs[s], ss[s], bases)
        else:
            for s in cutlass.range_constexpr(self.stages - 1):
                self._load_row(mX, mXScale, cutlass.min(program + s * grid, last), tidx,
                               xs[s], ss[s], bases)

        for base in cutlass.range(program, rows, self.stages * grid):
            for s in cutlass.range_constexpr(self.stages):
                x_slot, s_slot = xs[s], ss[s]
                if const_expr(self.shared_ring):
                    # This row's copies landed (the ring's later rows may be in flight): its
                    # bytes and multipliers to registers. No load of the loop sets a register
                    # scoreboard, so no wait of a stage sits behind the row just issued (the
                    # register ring's does: bench/NOTES.md #132).
                    cute.arch.cp_async_wait_group(self.stages - 1)
                    cute.autovec_copy(xs[s], x_held)
                    if const_expr(self.group):
                        cute.autovec_copy(ss[s], s_held)
                    x_slot, s_slot = x_held, s_held
                else:
                    ahead = (s + self.stages - 1) % self.stages
                    self._load_row(mX, mXScale,
                                   cutlass.min(base + (s + self.stages - 1) * grid, last),
                                   tidx, xs[ahead], ss[ahead], bases)
                row = base + s * grid
                if row < rows:
                    x = self._values(x_slot, s_slot, xf)
                    if const_expr(not self.recompute_t):
                        self._store_t(x, w, t, offset)
                    sq = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    part_sq = cute.arch.warp_reduction(sq, operator.add)
                    part_max = Float32(0.0)
                    if const_expr(row_amax):
                        if const_expr(self.recompute_t):
                            self._recompute_t(xs[s], mW, w_in, t, tidx, offset, zeros[0],
                                              False)
                        if const_expr(self.group):
                            # From +0, so the warp's maximum is one REDUX (_warp_max) in
                            # place of five shuffles and maxima (the module docstring).
                            part_max = _warp_max(self._thread_max(t, per_thread))
                        else:
                            # From |t[0]|, not from 0: m differs only where every |t| of the
                            # thread is NaN (NaN, not 0); fmax drops that NaN in the warp's
                            # and the warps' folds, and only a row all NaN ends with a NaN
                            # amax, which gives scale 1 (and leaves delayed's fmax(acc, .)
                            # at acc) as 0 does: the same outputs, one FMNMX fewer.
                            m = cute.math.absf(t[0])
                            for i in cutlass.range_constexpr(1, per_thread):
                                m = cute.arch.fmax(m, cute.math.absf(t[i]))
                            part_max = cute.arch.warp_reduction(m, cute.arch.fmax)
                    parity = s % 2
                    if const_expr(self.group):
                        # Every lane, the same bits to the same words (fp32 addition
                        # commutes, so the butterfly leaves every lane the same sum): with
                        # lane 0's stores alone ptxas holds the row arithmetic in uniform
                        # registers and moves each row's addresses out of them, 4-28
                        # instructions a loop more (bench/NOTES.md #124).
                        sums[warp, 0, parity] = part_sq
                        sums[warp, 1, parity] = part_max
                    elif lane == 0:
                        sums[warp, 0, parity] = part_sq
                        sums[warp, 1, parity] = part_max
                    cute.arch.barrier()
                    # Folded from warp 0's partials, not from 0: a sum of squares from +0 is
                    # never -0, so 0 + it is it (a NaN stays the canonical NaN); a warp's
                    # maximum of |t| is a number >= +0, fmax(0, it) being it, or NaN where
                    # its threads saw only NaN, which the fmax fold drops as fmax(0, NaN)
                    # does unless every warp's is NaN (the row all NaN, as above): the same
                    # outputs with two instructions fewer a row. FP8 x's maxima, each +0, a
                    # number or +inf: lane i reads warp i % warps's, one REDUX folds them.
                    total = sums[0, 0, parity]
                    tmax = Float32(0.0)
                    if const_expr(row_amax and self.group):
                        tmax = _warp_max(sums[lane % self.warps, 1, parity])
                    elif const_expr(row_amax):
                        tmax = sums[0, 1, parity]
                    for i in cutlass.range_constexpr(1, self.warps):
                        total = total + sums[i, 0, parity]
                        if const_expr(row_amax and not self.group):
                            tmax = cute.arch.fmax(tmax, sums[i, 1, parity])
                    rstd = cute.math.rsqrt(total * inv_n + eps)
                    if tidx == 0:
                        mRstd[row] = rstd
                    if const_expr(self.recompute_t and self.scaling != "amax"
                                  and not self.column_amax):
                        self._recompute_t(xs[s], mW, w_in, t, tidx, offset, zeros[0], True)
                    if const_expr(row_amax):
                        amax = tmax * rstd  # exactly the largest |y| of the row
                        if const_expr(self.scaling == "row"):
                            scale = self._scale_of(amax)
                            if const_expr(self.column_amax and self.recompute_t):
                                q_row = self._row_view(mQ, bases[2], row, tidx)
                                for r in cutlass.range_constexpr(self.reps):
                                    self._recompute_t(xs[s], mW, w_in, t, tidx, offset,
                                                      zeros[0], True, r)
                                    self._quantize_rep(t, y, q_row, rstd, scale, r, columns)
                            else:
                                if const_expr(self.column_amax):
                                    self._quantize_keeping_column_maxima(t, y, columns, rstd,
                                                                         scale)
                                else:
                                    for i in cutlass.range_constexpr(per_thread):
                                        self._quantize(t, y, rstd, scale, i)
                                q.store(y.load().to(self.fp8_dtype))
                                cute.autovec_copy(q_bytes,
                                                  self._row_view(mQ, bases[2], row, tidx))
                            if tidx == 0:
                                mQScale[row, 0] = Float32(1.0) / scale
                        else:
                            acc[0] = cute.arch.fmax(acc[0], amax)
                            if const_expr(self.scaling == "delayed"):
                                for i in cutlass.range_constexpr(per_thread):
                                    self._quantize(t, y, rstd, given, i)
                                q.store(y.load().to(self.fp8_dtype))
                                cute.autovec_copy(q_bytes,
                                                  self._row_view(mQ, bases[2], row, tidx))
                    else:
                        self._quantize_blocks(t, y, q, q_bytes, rstd, row, tidx, lane, bits,
                                              mQ, mQScale, bases[2])
                if const_expr(self.shared_ring):
                    # The slot refilled once the row is done with it: its shared loads have
                    # returned (their values fed the row's sums before its barrier). A refill
                    # issued while they are in flight races them: cp.async is not ordered
                    # after the thread's own earlier shared loads (NOTES #133).
                    self._stage_row(copies, mX,
                                    cutlass.min(base + (s + self.stages) * grid, last), tidx,
                                    xs[s], ss[s], bases)
        if const_expr(self.shared_ring):
            cute.arch.cp_async_wait_group(0)  # no copy left in flight into a freed CTA
        # Two ifs: one decided when tracing, one at run time.
        if const_expr(self.scaling in ("amax", "delayed")):  # noqa: SIM102
            if tidx == 0:
                mAmax[program] = acc[0]
        if const_expr(self.column_amax):
            out = cute.make_rmem_tensor(shape, Float32)
            cute.autovec_copy(columns, self._chunked(out.iterator, 4, self.vec))
            cute.autovec_copy(out, self._thread_view(mAmax[program, None], tidx))

    @cute.jit
    def _quantize_keeping_column_maxima(self, t: cute.Tensor, y: cute.Tensor,
                                        columns: cute.Tensor, rstd: Float32, scale: Float32):
        """``_quantize``'s values into ``y`` and this thread's column maxima (shared memory)
        with the row's ``|t * rstd|`` (y as q scales it), a vector at a time: each product
        is used where it is made, where folding the maxima after the row's quantization
        kept the products live across it (sm_90a, 4-row trip: 16 spill stores and 16 loads
        at 16384 columns, (512, 4, 1), against 6 and 6; 4 and 4 at 4096 against none;
        bench/NOTES.md #120). The same products, so the same bits."""
        for r in cutlass.range_constexpr(self.reps):
            self._quantize_rep_keeping_column_maxima(t, y[None, r], columns, rstd, scale, r)

    @cute.jit
    def _quantize_rep_keeping_column_maxima(self, t: cute.Tensor, out: cute.Tensor,
                                            columns: cute.Tensor, rstd: Float32,
                                            scale: Float32, r: int):
        """Rep ``r``'s fp32 q values into ``out`` (``vec`` of them), each ``|t * rstd|``
        folded into the rep's column slots: one product for both."""
        m = cute.make_rmem_tensor((self.vec,), Float32)
        m_chunks = cute.make_tensor(m.iterator, cute.make_layout((4, self.vec // 4)))
        cute.autovec_copy(columns[None, r], m_chunks)
        for e in cutlass.range_constexpr(self.vec):
            normed = t[e, r] * rstd
            m[e] = cute.arch.fmax(m[e], cute.math.absf(normed))
            out[e] = self._saturated(normed * scale)
        cute.autovec_copy(m_chunks, columns[None, r])

    @cute.jit
    def _quantize_blocks(self, t, y, q, q_bytes, rstd, row, tidx, lane, bits, mQ, mQScale,
                         q_base):
        """Block and MX scales: a block is ``block_lanes`` consecutive lanes' vectors of one
        rep; its amax a butterfly over those lanes. Block scaling where a lane group has a
        lane for every rep (``reps <= block_lanes``) divides once a row a lane: lane ``g``
        of the group computes rep ``g``'s scale and ``scale_inv`` (every lane knows every
        rep's amax after the butterflies), stores the latter and hands the scale to the
        group by shuffles; dividing for every rep on every lane put two IEEE divisions with
        their slow-path calls and convergence barriers in every rep (block 2352 SASS
        instructions at 4096 columns against 2000, bench/NOTES.md #58, #100). Else (MX,
        whose scales are exponent arithmetic, or more reps than lanes) every lane takes each
        rep's scale itself, and the first lane of a block stores it. With ``recompute_t``
        each rep's 8 bytes of q are converted and stored as soon as the rep is quantized
        rather than the row's at the end: the same values, two registers of q live instead
        of ``2 * reps``. ``q_base``: :meth:`_thread_bases`'s q (None: from the row's)."""
        q_row = self._row_view(mQ, q_base, row, tidx)
        g = lane % self.block_lanes
        if const_expr(self.scatter):
            # Lanes [r * spread, (r + 1) * spread) of a group hold rep r's amax; lane g takes
            # the scale of rep g // spread, the first of those lanes stores it.
            spread = self.block_lanes // self.reps
            mine = self._scattered_block_amax(t, lane) * rstd
            if const_expr(self.scaling == "mx"):
                k = self._mx_exponent(mine, bits)
                scale_mine = self._power_of_two(-k, bits)
            else:
                scale_mine = self._scale_of(mine)
            if g % spread == 0:
                block = (tidx - g + (g // spread) * self.threads) // self.block_lanes
                if const_expr(self.scaling == "mx"):
                    mQScale[row, block] = cutlass.Uint8(k + 127)
                else:
                    mQScale[row, block] = Float32(1.0) / scale_mine
            for r in cutlass.range_constexpr(self.reps):
                self._quantize_rep(t, y, q_row, rstd, self._group_shuffle(scale_mine, r * spread),
                                   r)
        elif const_expr(self.scaling == "block" and self.reps <= self.block_lanes):
            mine = Float32(0.0)
            for r in cutlass.range_constexpr(self.reps):
                m = self._block_amax(t, r)
                if g == r:
                    mine = m * rstd
            scale_mine = self._scale_of(mine)
            if g < self.reps:
                # Lane g's block: rep g's of lane (lane - g)'s group.
                mQScale[row, (tidx - g + g * self.threads) // self.block_lanes] = (
                    Float32(1.0) / scale_mine)
            for r in cutlass.range_constexpr(self.reps):
                self._quantize_rep(t, y, q_row, rstd, self._group_shuffle(scale_mine, r), r)
        else:
            for r in cutlass.range_constexpr(self.reps):
                amax = self._block_amax(t, r) * rstd
                block = (tidx + r * self.threads) // self.block_lanes
                if const_expr(self.scaling == "mx"):
                    k = self._mx_exponent(amax, bits)
                    scale = self._power_of_two(-k, bits)
                    if g == 0:
                        mQScale[row, block] = cutlass.Uint8(k + 127)
                else:
                    scale = self._scale_of(amax)
                    if g == 0:
                        mQScale[row, block] = Float32(1.0) / scale
                self._quantize_rep(t, y, q_row, rstd, scale, r)
        if const_expr(not self.recompute_t):
            q.store(y.load().to(self.fp8_dtype))
            cute.autovec_copy(q_bytes, q_row)

    @cute.jit
    def _scattered_block_amax(self, t: cute.Tensor, lane: Int32) -> Float32:
        """The largest |t| of rep ``g // (block_lanes // reps)``'s block, lane ``g`` of the
        block's lanes: a reduce-scatter. At the butterfly's first ``log2(reps)`` levels a
        lane holds ``k`` reps' maxima and sends half of them: the lane with the level's bit
        set keeps the upper half and sends the lower, its partner the reverse, and each
        takes the max of what it kept and what it got; then a butterfly of one value over
        the lanes left. Per lane ``reps - 1 + log2(block_lanes / reps)`` shuffles and as
        many maxima, and two selects a value sent, against ``reps * log2(block_lanes)``
        shuffles and maxima of a butterfly a rep (:meth:`_block_amax`). The same value bit
        for bit: every operand is a max of absolute values started at 0 (``fmax`` skips a
        NaN), so no NaN and no -0 reach the shuffles, and the max of such a set is exact in
        any order."""
        vals = []
        for r in cutlass.range_constexpr(self.reps):
            vals.append(self._thread_amax(t, r))
        levels = self.block_lanes.bit_length() - 1
        for level in cutlass.range_constexpr(levels):
            offset = self.block_lanes >> (level + 1)
            half = self.reps >> (level + 1)
            if const_expr(half > 0):
                upper = (lane & offset) != 0
                kept = []
                for i in cutlass.range_constexpr(half):
                    send = Float32(cutlass.select_(upper, vals[i], vals[i + half]))
                    keep = Float32(cutlass.select_(upper, vals[i + half], vals[i]))
                    kept.append(cute.arch.fmax(keep,
                                               cute.arch.shuffle_sync_bfly(send, offset)))
                vals = kept
            else:
                vals = [cute.arch.fmax(vals[0], cute.arch.shuffle_sync_bfly(vals[0], offset))]
        return vals[0]

    @cute.jit
    def _group_shuffle(self, value: Float32, g: int) -> Float32:
        """``value`` of lane ``g`` of this lane's block group: ``shfl.sync.idx`` with the
        group as its segment (``c``'s segment mask ``32 - block_lanes``, as CUDA's
        ``__shfl_sync`` with ``width``), so the source lane is ``(lane & ~(block_lanes - 1))
        | g`` with ``g`` an immediate: the lane ``lane - lane % block_lanes + g`` reads, with
        no index computed (bench/NOTES.md #114)."""
        return cute.arch.shuffle_sync(value, g,
                                      mask_and_clamp=((32 - self.block_lanes) << 8) | 0x1F)

    @cute.jit
    def _thread_max(self, t: cute.Tensor, n: int) -> Float32:
        """The largest |t| of this thread's ``n`` elements, folded from +0: +0, a positive
        number or +inf, never NaN (``fmax`` skips it) nor -0, as :func:`_warp_max` takes."""
        m = Float32(0.0)
        for i in cutlass.range_constexpr(n):
            m = cute.arch.fmax(m, cute.math.absf(t[i]))
        return m

    @cute.jit
    def _thread_amax(self, t: cute.Tensor, r: int) -> Float32:
        """The largest |t| of this thread's vector of rep ``r`` (0 if none is above 0)."""
        m = Float32(0.0)
        for e in cutlass.range_constexpr(self.vec):
            m = cute.arch.fmax(m, cute.math.absf(t[e, r]))
        return m

    @cute.jit
    def _block_amax(self, t: cute.Tensor, r: int) -> Float32:
        """The largest |t| of rep ``r``'s block: this thread's vector, then a butterfly over
        the block's lanes."""
        m = Float32(0.0)
        for e in cutlass.range_constexpr(self.vec):
            m = cute.arch.fmax(m, cute.math.absf(t[e, r]))
        return cute.arch.warp_reduction(m, cute.arch.fmax, threads_in_group=self.block_lanes)

    @cute.jit
    def _quantize_rep(self, t: cute.Tensor, y: cute.Tensor, q_row: cute.Tensor, rstd: Float32,
                      scale: Float32, r: int, columns: cute.Tensor | None = None):
        """Rep ``r``'s fp32 q values into ``y`` or, with ``recompute_t``, converted and
        stored at once; with ``columns`` (``recompute_t``'s row scaling keeping column
        maxima) folding each ``|t * rstd|`` into the rep's column slots as
        :meth:`_quantize_keeping_column_maxima` does: the same products, so q has the bits
        of the kernel without ``columns`` (bench/NOTES.md #125)."""
        if const_expr(self.recompute_t):
            y_r = cute.make_rmem_tensor((self.vec,), Float32)
            if const_expr(columns is not None):
                self._quantize_rep_keeping_column_maxima(t, y_r, columns, rstd, scale, r)
            else:
                for e in cutlass.range_constexpr(self.vec):
                    y_r[e] = self._saturated(t[e, r] * rstd * scale)
            q_r = cute.make_rmem_tensor((self.vec,), self.fp8_dtype)
            q_r.store(y_r.load().to(self.fp8_dtype))
            cute.autovec_copy(cute.recast_tensor(q_r, cutlass.Uint8), q_row[None, r])
        else:
            for e in cutlass.range_constexpr(self.vec):
                y[e, r] = self._saturated(t[e, r] * rstd * scale)
