"""Probe (GPU): does the row-to-CTA schedule explain why tilenorm's forwards reach 92-96% of
copy bandwidth where Quack's non-persistent forward reaches 99-100% (bench/NOTES.md #64)?
And (#136): does torch.compile's schedule, each row walked twice, the second pass from L1
(``"two_pass"`` below), take the CuTe forward to torch.compile's 100-101% of copy?

One bf16 / fp16 RMSNorm forward (``y = x * rstd * w``, ``rstd = 1 / sqrt(mean(x^2) + eps)``,
fp32 math, y in x's dtype, rstd fp32 a row, the weight in x's dtype) written once in the CuTe
DSL, with the row walk a compile-time switch (``schedule``):

- ``"persistent"``: SMs x ``ctas_per_sm`` programs; program ``p`` takes rows ``p, p + grid,
  ...`` with a register ring of R rows (the loads of row ``r + (R - 1) * grid`` issued before
  row ``r`` is reduced), as tilenorm's CuTe kernels (tilenorm/kernels/cute_row_norm_fp8.py);
- ``"oneshot"``: ``ceil(M / R)`` CTAs; CTA ``b`` issues the 16-byte loads of rows ``[b * R,
  b * R + R)`` first, then reduces and stores each row in order and exits: no loop, so the
  hardware hands the next CTA to whichever SM frees a slot first;
- ``"two_pass"``: M CTAs of one row each, R read as the 16-byte vectors a thread loads a
  step (``TWO_PASS_CONFIGS``, ``--two-pass-configs``): see ``_two_pass_row``; the weight is
  read through L1 with each step, whatever ``--weight`` says; ``"two_pass_unrolled"`` the
  same with both loops unrolled (#138: pass 1 then issues every step's load at once).

Everything else is one code path: threads per CTA, R, the thread-to-column mapping
(``_thread_view``: ``reps`` 16-byte vectors a thread, ``threads`` vectors apart), the weight
(``--weight``: in shared memory, read back every row, by default; its fp32 copy in registers
makes the persistent ring spill at 4096 and 8192 columns, see the kernel), the warp butterfly
then shared memory in warp order (one barrier a row), y stored from registers (``STG.128``),
``min_blocks_per_mp`` = ``ctas_per_sm``. NOTES #64 also suspects
``preferred_smem_carveout=233472`` (the value tilenorm's kernels pass) is not a valid
percentage for the driver's attribute: each variant is compiled with each value of
``--carveouts``, "none" omitting it (the DSL then derives a carveout from the device's shared
memory per SM). With the weight in shared memory (8 KB a CTA at 4096 columns) the carveout
could also bound how many CTAs an SM holds, which tilenorm's kernels (a few bytes of shared
memory) do not risk: a valid percentage, ``--carveouts 233472,none,100``, tells.

For each shape, config (threads, R, CTAs an SM), schedule and carveout: y and rstd poisoned
with NaN, one launch checked against float64 (every element written, y relative error
<= 1e-2 bf16 / 1e-3 fp16, rstd <= 1e-5), a rerun bit-identical, then CUDA-graph time; Quack's
forward (``quack.rmsnorm.rmsnorm_fwd``, when it imports) and tilenorm's op
(``tilenorm.rms_norm_forward``) on the same inputs. Timings are taken in ``--rounds`` rounds,
every variant of a shape once a round (drift over the run falls on all alike), median kept.
GB/s of the one-pass bytes (x and w read once, y and rstd written) against the copy bandwidth
of the same process. Decision (#64): one-shot >= 98% with persistent <= 95% names the schedule.

    python bench/experiments/cute_forward_schedule_probe.py --out probe.json
    python bench/experiments/cute_forward_schedule_probe.py --compile-only   # CPU, sm_90a

``--compile-only`` needs no GPU: every variant compiled for ``--arch`` with fake tensors, its
cubin kept and read by ``cuobjdump`` (pip: nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) for
registers, stack, shared memory and spill instructions (without cuobjdump, registers, stack
and shared memory off the ELF, no instruction counts).
"""

from __future__ import annotations

import argparse
import json
import operator
import re
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tilenorm.launch import cute as cute_launch  # noqa: E402

# The DSL's package folder onto sys.path (its wheel's .pth file may be absent, see
# tilenorm/launch/cute.py) before the kernel class below imports it.
cute_launch.available()

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, const_expr  # noqa: E402

SCHEDULES = ("persistent", "oneshot", "two_pass", "two_pass_unrolled")
#: The schedules of one row a CTA walked twice (``_two_pass_row``), which read R as the
#: vectors a thread loads a step and take ``TWO_PASS_CONFIGS``.
TWO_PASS = ("two_pass", "two_pass_unrolled")
#: Where a CTA keeps the weight between rows (see ScheduleProbeForward.kernel).
WEIGHT_IN = ("shared", "registers")
EPS = 1e-6
DEFAULT_SHAPES = "32768x4096,65536x2048,16384x8192"
#: (threads, R rows a CTA holds, CTAs per SM) per width: the FP8 forward's table entries
#: (tilenorm/settings_fp8.py, NOTES #56), and R = 2 at 4096 (Quack's rows a CTA there).
CONFIGS = {2048: [(128, 4, 6)], 4096: [(128, 4, 4), (128, 2, 4)], 8192: [(256, 4, 2)]}
#: "two_pass" configs, (threads, vectors a thread a step, CTAs per SM): at most 32 registers
#: and no spills on sm_90a (#136), inductor's 512 / 1024 threads among them.
TWO_PASS_CONFIGS = {4096: [(256, 1, 8), (512, 1, 4), (128, 1, 16)],
                    7168: [(128, 1, 16), (448, 1, 4), (896, 1, 2)],
                    8192: [(512, 1, 4), (256, 1, 8), (1024, 1, 2)],
                    32768: [(1024, 1, 2), (512, 1, 4)]}
#: What tilenorm's CuTe kernels pass today (bytes of shared memory per SM, NOTES #64).
TILENORM_CARVEOUT = 233472
#: L2 eviction policies for ``.L2::cache_hint`` loads: what ``createpolicy.fractional`` gives
#: at fraction 1.0 (CUTLASS's ``CacheHintSm90``), the hints inductor's loads carry (#138).
L2_EVICT_FIRST, L2_EVICT_LAST = 0x12F0000000000000, 0x14F0000000000000
DTYPES = {"bfloat16": (torch.bfloat16, cutlass.BFloat16, 1e-2),
          "float16": (torch.float16, cutlass.Float16, 1e-3)}


class ScheduleProbeForward:
    """The RMSNorm forward for one (dtype, width, launch config, schedule, carveout);
    ``__call__`` launches it on ``grid`` CTAs (SMs x ctas_per_sm, or ceil(M / R))."""

    def __init__(self, dtype, cols: int, threads: int, rows_per_cta: int, ctas_per_sm: int,
                 schedule: str, carveout: int | None, weight_in: str = "shared",
                 l2_hints: bool = False):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if weight_in not in WEIGHT_IN:
            raise ValueError(f"weight_in must be one of {WEIGHT_IN}, got {weight_in!r}")
        self.weight_in = weight_in
        if l2_hints and schedule == "persistent":
            raise ValueError("L2 hints are for the one-shot and two-pass schedules")
        self.l2_hints = l2_hints
        self.dtype = dtype
        self.cols = cols
        self.threads = threads
        self.vec = 128 // dtype.width
        if cols % (self.vec * threads):
            raise ValueError(f"{cols} columns are not whole {self.vec}-element vectors of "
                             f"{threads} threads")
        self.reps = cols // (self.vec * threads)
        # The persistent ring alternates two shared-memory slots by row; an odd ring would
        # put two consecutive rows (the loop's last and next first) on one slot: a race.
        if rows_per_cta < 1 or (schedule == "persistent" and rows_per_cta % 2):
            raise ValueError(f"R must be >= 1, and even when persistent; got {rows_per_cta}")
        # "two_pass": R is the vectors a thread loads a step, whole steps a row.
        if schedule in TWO_PASS and self.reps % rows_per_cta:
            raise ValueError(f"{self.reps} vectors a thread are not whole steps of "
                             f"{rows_per_cta}")
        self.rows_per_cta = rows_per_cta
        self.ctas_per_sm = ctas_per_sm
        self.schedule = schedule
        self.carveout = carveout
        self.warps = threads // cute.arch.WARP_SIZE

    def shared_bytes(self) -> int:
        """Dynamic shared memory a CTA allocates: the row sums and, in "shared", the weight
        (16-byte aligned each). The carveout decides how many CTAs' worth an SM sets aside."""
        sums = -(-self.warps * 2 * 4 // 16) * 16
        weight = self.weight_in == "shared" and self.schedule not in TWO_PASS
        return sums + (self.cols * self.dtype.width // 8 if weight else 0)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mRstd: cute.Tensor,
                 eps: Float32, grid: Int32, stream):
        # Omitted, the DSL reads the device's shared memory per SM when compiling (so a
        # compile without a GPU must be told it: see _device_free_compile).
        extra = {} if self.carveout is None else {"preferred_smem_carveout": self.carveout}
        self.kernel(mX, mW, mY, mRstd, eps).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream,
            max_number_threads=[self.threads, 1, 1], min_blocks_per_mp=self.ctas_per_sm,
            **extra)

    @cute.jit
    def _load(self, src: cute.Tensor, dst: cute.Tensor, l1, l2: int):
        """``src`` (global) into ``dst`` (registers) in 16-byte loads, with L1 eviction
        priority ``l1`` and, under ``l2_hints``, the L2 eviction policy ``l2``
        (``LDG.E...`` with a cache-policy operand): what Triton emits for inductor's
        ``eviction_policy`` (``ld.global.L1::evict_*.L2::cache_hint``, #138)."""
        if const_expr(self.l2_hints):
            atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), self.dtype,
                                       num_bits_per_copy=128, l1c_evict_priority=l1)
            cute.copy(atom, src, dst, cache_policy=cutlass.Int64(l2))
        else:
            cute.autovec_copy(src, dst, l1c_evict_priority=l1)

    @cute.jit
    def _thread_view(self, row: cute.Tensor, tidx: Int32) -> cute.Tensor:
        """This thread's (vec, reps) elements of a row: one 16-byte vector per rep, the reps
        ``threads`` vectors apart (every warp's load one contiguous 512 bytes)."""
        vectors = cute.zipped_divide(row, (self.vec,))
        blocks = cute.logical_divide(vectors, (None, self.threads))
        return blocks[(None, (tidx, None))]

    @cute.jit
    def _rstd(self, squares, sums: cute.Tensor, mRstd: cute.Tensor, row: Int32, parity: int,
              tidx: Int32, lane: Int32, warp: Int32, eps: Float32) -> Float32:
        """The row's rstd from this thread's ``squares``, stored by thread 0: a warp
        butterfly, then the warps' sums through shared memory slot ``parity`` in warp order
        (a fixed tree), one barrier."""
        part = cute.arch.warp_reduction(squares.reduce(cute.ReductionOp.ADD, Float32(0.0), 0),
                                        operator.add)
        if lane == 0:
            sums[warp, parity] = part
        cute.arch.barrier()
        total = Float32(0.0)
        for i in cutlass.range_constexpr(self.warps):  # warp order: a fixed tree
            total = total + sums[i, parity]
        rstd = cute.math.rsqrt(total * Float32(1.0 / self.cols) + eps)
        if tidx == 0:
            mRstd[row] = rstd
        return rstd

    @cute.jit
    def _norm_row(self, x_in: cute.Tensor, w: cute.Tensor, w_row: cute.Tensor,
                  y: cute.Tensor, sums: cute.Tensor, mY: cute.Tensor, mRstd: cute.Tensor,
                  row: Int32, parity: int, tidx: Int32, lane: Int32, warp: Int32, eps: Float32):
        """Reduce and store one row held in registers: the same code for both schedules."""
        x = x_in.load().to(Float32)
        if const_expr(self.weight_in == "shared"):
            # Read with the row's conversion, so that it lands during the reduction.
            cute.autovec_copy(self._thread_view(w, tidx), w_row)
        rstd = self._rstd(x * x, sums, mRstd, row, parity, tidx, lane, warp, eps)
        if const_expr(self.weight_in == "shared"):
            y.store((x * rstd * w_row.load().to(Float32)).to(self.dtype))
        else:
            y.store((x * rstd * w.load()).to(self.dtype))
        cute.autovec_copy(y, self._thread_view(mY[row, None], tidx))

    @cute.jit
    def _two_pass_row(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor,
                      mRstd: cute.Tensor, sums: cute.Tensor, row: Int32, tidx: Int32,
                      lane: Int32, warp: Int32, eps: Float32):
        """inductor's schedule (bench/NOTES.md #136): the row walked twice in steps of R
        vectors a thread, in a loop (not unrolled, or unrolled: ``schedule``), so a thread
        holds few registers and the SM many CTAs. Pass 1 sums x^2 (x loaded ``evict_last``: the row
        stays in L1 for pass 2); pass 2 loads x again (``evict_first``) and the weight
        (``evict_last``), stores y. The squares add up element-wise across steps, then
        through the warp butterfly and shared memory in warp order: a fixed tree."""
        step = self.rows_per_cta
        steps = self.reps // step
        chunk = (self.vec, step)
        xs = cute.logical_divide(self._thread_view(mX[row, None], tidx), (None, step))
        ys = cute.logical_divide(self._thread_view(mY[row, None], tidx), (None, step))
        ws = cute.logical_divide(self._thread_view(mW, tidx), (None, step))
        x = cute.make_rmem_tensor(chunk, self.dtype)
        w = cute.make_rmem_tensor(chunk, self.dtype)
        y = cute.make_rmem_tensor(chunk, self.dtype)
        acc = cute.make_rmem_tensor(chunk, Float32)
        acc.fill(0.0)
        # "two_pass_unrolled": both loops unrolled, so pass 1 issues every step's load
        # before its first square, as inductor's loop over a compiled-in width does.
        unrolled = const_expr(self.schedule == "two_pass_unrolled")
        for c in cutlass.range(steps, unroll=1, unroll_full=unrolled):
            self._load(xs[(None, (None, c))], x, cute.nvgpu.CacheEvictionPriority.EVICT_LAST,
                       L2_EVICT_LAST)
            v = x.load().to(Float32)
            acc.store(acc.load() + v * v)
        rstd = self._rstd(acc.load(), sums, mRstd, row, 0, tidx, lane, warp, eps)
        for c in cutlass.range(steps, unroll=1, unroll_full=unrolled):
            self._load(xs[(None, (None, c))], x, cute.nvgpu.CacheEvictionPriority.EVICT_FIRST,
                       L2_EVICT_FIRST)
            self._load(ws[(None, (None, c))], w, cute.nvgpu.CacheEvictionPriority.EVICT_LAST,
                       L2_EVICT_LAST)
            y.store((x.load().to(Float32) * rstd * w.load().to(Float32)).to(self.dtype))
            cute.autovec_copy(y, ys[(None, (None, c))])

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mRstd: cute.Tensor,
               eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        program, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        rows = mX.shape[0]
        last = rows - 1
        ring = self.rows_per_cta
        persistent = const_expr(self.schedule == "persistent")

        smem = cutlass.memory.SmemAllocator()
        # (warp, parity): consecutive rows use different slots, so one barrier a row orders
        # every write before its reads and every read before the slot's next write.
        sums = smem.allocate_tensor(Float32, cute.make_layout((self.warps, 2)), 16)
        if const_expr(self.schedule in TWO_PASS):
            # One row a CTA, its reads through L1 (the weight too: WEIGHT_IN does not apply).
            self._two_pass_row(mX, mW, mY, mRstd, sums, program, tidx, lane, warp, eps)
            return

        # The weight: "registers" holds its fp32 copy (32 registers a thread at 4096 and 8192
        # columns), which ptxas fits beside the persistent ring of 4 rows at 128 registers only
        # by spilling 7 values (LDLs every row; sm_90a, DSL 4.8.1); tilenorm's FP8 kernel does
        # not spill because its compiled loop keeps the weight in bf16 and converts it every
        # row, a choice of the compiler this kernel does not get. "shared" (the default) puts
        # the weight in shared memory, each thread reading back its own vectors every row
        # (reps LDS.128): no spills at the default configurations, the same code in both
        # schedules.
        shape = (self.vec, self.reps)
        w_in = cute.make_rmem_tensor(shape, self.dtype)
        cute.autovec_copy(self._thread_view(mW, tidx), w_in)
        xs = [cute.make_rmem_tensor(shape, self.dtype) for _ in range(ring)]
        y = cute.make_rmem_tensor(shape, self.dtype)
        w_row = cute.make_rmem_tensor(shape, self.dtype)
        if const_expr(self.weight_in == "shared"):
            w = smem.allocate_tensor(self.dtype, cute.make_layout((self.cols,)), 16)
        else:
            w = cute.make_rmem_tensor(shape, Float32)

        # Row s of the CTA: program + s * grid (persistent) or program * R + s (one-shot).
        first = program
        step = grid
        if const_expr(not persistent):
            first = program * ring
            step = 1
        # Persistent: R - 1 rows ahead, the loop loads the R-th; one-shot: all R rows' loads
        # issued before any row is reduced. Rows past the end are clamped to the last row:
        # loaded, never used.
        for s in cutlass.range_constexpr(ring - 1 if persistent else ring):
            # x is read once: under l2_hints, evicted from L2 first.
            self._load(self._thread_view(mX[cutlass.min(first + s * step, last), None], tidx),
                       xs[s], cute.nvgpu.CacheEvictionPriority.EVICT_NORMAL, L2_EVICT_FIRST)
        # After the rows' loads are issued: this waits for the weight's. Each thread reads
        # back only what it wrote, so no barrier before; the barrier of every row keeps the
        # compiler from hoisting the reads out of the rows.
        if const_expr(self.weight_in == "shared"):
            cute.autovec_copy(w_in, self._thread_view(w, tidx))
        else:
            w.store(w_in.load().to(Float32))

        if const_expr(persistent):
            for base in cutlass.range(program, rows, ring * grid):
                for s in cutlass.range_constexpr(ring):
                    ahead = (s + ring - 1) % ring
                    cute.autovec_copy(
                        self._thread_view(
                            mX[cutlass.min(base + (s + ring - 1) * grid, last), None], tidx),
                        xs[ahead])
                    row = base + s * grid
                    if row < rows:
                        self._norm_row(xs[s], w, w_row, y, sums, mY, mRstd, row, s % 2, tidx,
                                       lane, warp, eps)
        else:
            for s in cutlass.range_constexpr(ring):
                row = first + s
                if row < rows:
                    self._norm_row(xs[s], w, w_row, y, sums, mY, mRstd, row, s % 2, tidx, lane,
                                   warp, eps)


@dataclass(frozen=True)
class Variant:
    """One compiled kernel: compiled per row count, as tilenorm's CuTe kernels are (a
    compile-time row count keeps the loop's bounds out of registers, NOTES #38)."""

    rows: int
    cols: int
    dtype: str
    threads: int
    rows_per_cta: int
    ctas_per_sm: int
    schedule: str
    carveout: int | None
    weight_in: str = "shared"
    l2_hints: bool = False

    @property
    def label(self) -> str:
        carve = "none" if self.carveout is None else str(self.carveout)
        return (f"{self.schedule:>10} {self.rows}x{self.cols} "
                f"({self.threads}, {self.rows_per_cta}, {self.ctas_per_sm}) carveout {carve}"
                + ("" if self.weight_in == "shared" or self.schedule in TWO_PASS
                   else f" w:{self.weight_in}")
                + (" l2" if self.l2_hints else ""))

    def kernel(self) -> ScheduleProbeForward:
        return ScheduleProbeForward(DTYPES[self.dtype][1], self.cols, self.threads,
                                    self.rows_per_cta, self.ctas_per_sm, self.schedule,
                                    self.carveout, self.weight_in, self.l2_hints)

    def grid(self, sm_count: int) -> int:
        if self.schedule == "persistent":
            return min(self.rows, sm_count * self.ctas_per_sm)
        if self.schedule in TWO_PASS:
            return self.rows
        return -(-self.rows // self.rows_per_cta)


def _fake(dtype, shape, stride, align: int):
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def _device_free_compile(carveout: int | None):
    """Without a carveout and with ``min_blocks_per_mp`` > 1 the DSL asks the device for its
    shared memory per SM while compiling; without a GPU, answer what a Hopper (and a datacenter
    Blackwell) answers: 228 KB. Returns a function that undoes it."""
    from cutlass.base_dsl.runtime import cuda as dsl_cuda

    if carveout is not None:
        return lambda: None
    original = dsl_cuda.get_device_attribute
    attr = dsl_cuda.cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR

    def get_device_attribute(attribute, device_id: int = 0):
        if attribute == attr:
            return 233472
        return original(attribute, device_id)

    dsl_cuda.get_device_attribute = get_device_attribute

    def undo():
        dsl_cuda.get_device_attribute = original
    return undo


def compile_variant(v: Variant, arch: str | None = None, dump_dir: str | None = None):
    """``cute.compile`` of ``v`` over fake operands, called through TVM-FFI as ``fn(x, w, y,
    rstd, eps, grid)`` on the current stream. ``arch`` compiles without a GPU; ``dump_dir``
    keeps the cubin there."""
    dsl_dtype = DTYPES[v.dtype][1]
    kernel = v.kernel()
    # Rows contiguous: a row's offset a multiple of a compile-time stride (NOTES #38).
    x, y = (_fake(dsl_dtype, (v.rows, v.cols), (v.cols, 1), 16) for _ in range(2))
    w = _fake(dsl_dtype, (v.cols,), (1,), 16)
    rstd = _fake(Float32, (v.rows,), (1,), 4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = "--enable-tvm-ffi"
    if arch:
        options += f" --gpu-arch {arch}"
    if dump_dir:
        options += f" --keep-cubin --dump-dir {dump_dir}"
    undo = _device_free_compile(v.carveout) if arch else (lambda: None)
    try:
        return cute.compile(kernel, x, w, y, rstd, Float32(EPS), Int32(1), stream,
                            options=options)
    finally:
        undo()


# --- resources off the cubin (no GPU) --------------------------------------------------------


def _elf_resources(cubin: bytes) -> dict:
    """Registers and stack bytes of the (one) kernel off the cubin's ``.nv.info`` attributes
    (EIATTR_REGCOUNT 0x2f, EIATTR_FRAME_SIZE 0x11: symbol index, value), static shared bytes
    off its ``.nv.shared.<kernel>`` section: what cuobjdump -res-usage prints, without it."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(i):
        # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info
        return struct.unpack_from("<IIQQQQII", cubin, shoff + i * shentsize)

    names_at = header(shstrndx)[4]
    out = {"registers": None, "stack": None, "shared": None}
    for i in range(shnum):
        h = header(i)
        name = cubin[names_at + h[0]:cubin.index(b"\0", names_at + h[0])]
        if name.startswith(b".nv.shared.") and name != b".nv.shared.reserved.0":
            out["shared"] = h[5]
        if name != b".nv.info":
            continue
        data, at = cubin[h[4]:h[4] + h[5]], 0
        while at + 4 <= len(data):
            fmt, attr = data[at], data[at + 1]
            if fmt != 0x04:  # not EIFMT_SVAL: two bytes of value inline
                at += 4
                continue
            size, = struct.unpack_from("<H", data, at + 2)
            if size == 8 and attr in (0x2F, 0x11):
                _, value = struct.unpack_from("<II", data, at + 4)
                out["registers" if attr == 0x2F else "stack"] = value
            at += 4 + size
    return out


def resources(cubin_path: Path) -> dict:
    """Registers, stack bytes, static shared bytes, spill stores / loads (``STL`` / ``LDL``
    in the SASS) and 16-byte global loads / stores of a cubin; without cuobjdump, what the
    ELF says (no instruction counts)."""
    from bench.kernel_resources import cubin_resources, find_cuobjdump

    tool = find_cuobjdump()
    if tool is None:
        return {**_elf_resources(cubin_path.read_bytes()), "spill_stores": None,
                "spill_loads": None}
    found, sass = cubin_resources(cubin_path, tool)
    # With or without a cache qualifier (.EF, .EL, ...).
    return {**found, "stg128": len(re.findall(r"\bSTG\.E(?:\.\w+)*\.128\b", sass)),
            "ldg128": len(re.findall(r"\bLDG\.E(?:\.\w+)*\.128\b", sass))}


def variants(shapes, configs, dtype: str, carveouts, weight_in: str,
             schedules=SCHEDULES[:2], l2_hints=(False,)) -> list[Variant]:
    """Per shape, per schedule, per config (``configs`` by schedule, then width), each with
    every carveout and, but for the persistent schedule, each of ``l2_hints``."""
    out = []
    for m, n in shapes:
        for schedule in schedules:
            if n not in configs[schedule]:
                flag = "--two-pass-configs" if schedule in TWO_PASS else "--configs"
                raise SystemExit(f"no {schedule} config for {n} columns: give {flag}")
            for threads, ring, ctas in configs[schedule][n]:
                for carveout in carveouts:
                    for hints in (False,) if schedule == "persistent" else l2_hints:
                        out.append(Variant(m, n, dtype, threads, ring, ctas, schedule,
                                           carveout, weight_in, hints))
    return out


def compile_only(vs: list[Variant], arch: str) -> None:
    """Compile every variant for ``arch`` without a GPU and print what its cubin holds:
    registers, stack bytes, static shared bytes (cuobjdump's; the 1 KB sm_90 reserves),
    the dynamic shared bytes it allocates, spill stores / loads, 16-byte loads / stores."""
    print(f"{'variant':>62} {'regs':>5} {'stack':>6} {'static':>7} {'dynamic':>8} "
          f"{'STL/LDL':>8} {'LDG/STG.128':>11} {'compile s':>9}")
    failed = 0
    for v in vs:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            try:
                compile_variant(v, arch, tmp)
            except Exception as e:
                failed += 1
                print(f"{v.label:>62} FAILED {type(e).__name__}: {e}", flush=True)
                continue
            seconds = time.time() - t0
            cubins = sorted(Path(tmp).rglob("*.cubin"))
            if not cubins:
                print(f"{v.label:>62} compiled in {seconds:.1f} s, no cubin kept", flush=True)
                continue
            r = resources(cubins[0])

        def show(key, r=r):
            return "?" if r.get(key) is None else str(r[key])

        spills = f"{show('spill_stores')}/{show('spill_loads')}"
        vectors = f"{show('ldg128')}/{show('stg128')}"
        flag = "  SPILLS" if r.get("stack") or r.get("spill_stores") else ""
        print(f"{v.label:>62} {show('registers'):>5} {show('stack'):>6} {show('shared'):>7} "
              f"{v.kernel().shared_bytes():>8} {spills:>8} {vectors:>11} {seconds:9.1f}{flag}",
              flush=True)
    if failed:
        raise SystemExit(f"{failed} variant(s) failed to compile")


# --- GPU run ---------------------------------------------------------------------------------


def one_pass_bytes(m: int, n: int, elem: int) -> int:
    """x and w read once, y and rstd (fp32) written."""
    return 2 * m * n * elem + n * elem + 4 * m


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def check(y: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
          tol: float) -> dict[str, float]:
    """Every element written (NaN poison gone), then relative errors against float64 over
    every row."""
    from bench import common

    assert y.isfinite().all(), "y left unwritten (NaN poison)"
    assert rstd.isfinite().all(), "rstd left unwritten (NaN poison)"
    errs = common.float64_errors({"y": y, "rstd": rstd}, x, w, eps=EPS)
    assert errs["y"] <= tol, f"y off by {errs['y']:.2e} (> {tol})"
    assert errs["rstd"] <= 1e-5, f"rstd off by {errs['rstd']:.2e}"
    return errs


def prepare_cute(v: Variant, x, w, sm_count: int, tol: float) -> tuple:
    """Compile, check (poisoned, float64, bit-identical rerun); the launch closure to time."""
    t0 = time.time()
    fn = compile_variant(v)
    compile_s = time.time() - t0
    y = torch.full_like(x, float("nan"))
    rstd = torch.full((x.shape[0],), float("nan"), device=x.device)
    grid = v.grid(sm_count)

    def launch():
        fn(x, w, y, rstd, EPS, grid)

    launch()
    torch.cuda.synchronize()
    errs = check(y, rstd, x, w, tol)
    first = (_bits(y).clone(), _bits(rstd).clone())
    y.fill_(float("nan"))  # poison again: the rerun must write everything, identically
    rstd.fill_(float("nan"))
    launch()
    torch.cuda.synchronize()
    if not (torch.equal(_bits(y), first[0]) and torch.equal(_bits(rstd), first[1])):
        raise AssertionError("two runs differ")
    return launch, {"grid": grid, "smem_bytes": v.kernel().shared_bytes(),
                    "y_err": errs["y"], "rstd_err": errs["rstd"], "compile_s": compile_s}


def prepare_peers(x, w, tol: float, record: dict) -> dict[str, tuple]:
    """Quack's forward (when it imports), tilenorm's op and torch.compile of the reference
    forward (the sweep's), checked the same way (errors recorded, not asserted: they are
    the baselines, not under test)."""
    import tilenorm

    peers = {}
    m, n = x.shape
    try:
        from quack.rmsnorm import rmsnorm_fwd

        def quack():
            return rmsnorm_fwd(x, w, eps=EPS, store_rstd=True)

        out = quack()
        torch.cuda.synchronize()
        errs = _peer_errors(out[0], out[2], x, w)
        peers["quack"] = (quack, errs)
    except Exception as e:
        record["failures"].append(f"quack {m}x{n}: {type(e).__name__}: {e}")
        print(f"quack {m}x{n}: not timed ({type(e).__name__}: {e})", flush=True)

    def op():
        return tilenorm.rms_norm_forward(x, w, EPS)

    try:
        from tilenorm.pytorch import reference

        torch._dynamo.config.cache_size_limit = 1024  # a compile per shape, never eager
        torch._dynamo.config.recompile_limit = 1024
        compiled = torch.compile(lambda a, b: reference.norm_forward(a, b, None, EPS),
                                 dynamic=False)

        def inductor():
            return compiled(x, w)

        out = inductor()
        torch.cuda.synchronize()
        peers["torch.compile"] = (inductor, _peer_errors(out[0], out[3], x, w))
    except Exception as e:
        record["failures"].append(f"torch.compile {m}x{n}: {type(e).__name__}: {e}")
        traceback.print_exc(limit=3)

    try:
        y, _, rstd = op()
        torch.cuda.synchronize()
        peers["tilenorm op"] = (op, _peer_errors(y, rstd, x, w))
    except Exception as e:
        record["failures"].append(f"tilenorm op {m}x{n}: {type(e).__name__}: {e}")
        traceback.print_exc(limit=3)
    return peers


def _peer_errors(y, rstd, x, w) -> dict:
    from bench import common

    outs = {"y": y.view_as(x), "rstd": None if rstd is None else rstd.reshape(-1)}
    errs = common.float64_errors(outs, x, w, eps=EPS)
    return {"grid": None, "y_err": errs.get("y"), "rstd_err": errs.get("rstd"),
            "compile_s": None}


def profile_cases(cases, shape: str) -> None:
    """``--ncu``: each case launched twice, then once between ``cudaProfilerStart`` / ``Stop``
    (ncu ``--profile-from-start off`` counts that launch alone), in the printed order."""
    for provider, config, _, launch, _ in cases:
        launch()
        launch()
        torch.cuda.synchronize()
        print(f"profiled {shape} {provider} {config}", flush=True)
        torch.cuda.profiler.start()
        launch()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def run(args, shapes, configs, carveouts, planned: list[Variant]) -> None:
    """Time ``planned`` (every shape's variants, planned before the first is timed) beside
    the peers, shape by shape."""
    from bench import common
    from tilenorm.device import device_info

    torch_dtype, _, tol = DTYPES[args.dtype]
    elem = torch.tensor([], dtype=torch_dtype).element_size()
    info = device_info(torch.cuda.current_device())
    copy = common.copy_gbps()
    record = {"device": torch.cuda.get_device_name(), "commit": common.git_commit(),
              "torch": torch.__version__, "dtype": args.dtype, "sm_count": info.sm_count,
              "weight_in": args.weight, "shapes": args.shapes,
              "schedules": args.schedules,
              "configs": {schedule: {str(n): [list(c) for c in cs]
                                     for n, cs in configs[schedule].items()}
                          for schedule in args.schedules},
              "carveouts": carveouts, "l2_hints": args.l2_hints, "copy_gbps": copy,
              "rounds": args.rounds, "rows": [],
              "failures": []}
    print(f"{record['device']} ({info.sm_count} SMs): copy {copy:.0f} GB/s", flush=True)
    for m, n in shapes:
        g = torch.Generator(device="cuda").manual_seed(m + n)
        x = torch.randn(m, n, generator=g, device="cuda").to(torch_dtype)
        w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(torch_dtype)
        cases = []  # (provider, config, carveout, launch, facts)
        for v in [p for p in planned if (p.rows, p.cols) == (m, n)]:
            try:
                launch, facts = prepare_cute(v, x, w, info.sm_count, tol)
                cases.append((f"cute {v.schedule}" + (" l2" if v.l2_hints else ""),
                              [v.threads, v.rows_per_cta, v.ctas_per_sm], v.carveout, launch,
                              facts))
                print(f"checked {v.label}: grid {facts['grid']}, y err {facts['y_err']:.1e}, "
                      f"rstd err {facts['rstd_err']:.1e}, compile {facts['compile_s']:.1f} s",
                      flush=True)
            except Exception as e:
                traceback.print_exc(limit=3)
                record["failures"].append(f"{v.label}: {type(e).__name__}: {e}")
        for name, (launch, facts) in prepare_peers(x, w, tol, record).items():
            cases.append((name, None, None, launch, facts))
        if args.ncu:
            profile_cases(cases, f"{m}x{n}")
            continue
        times = [[] for _ in cases]
        for _ in range(args.rounds):
            for i, case in enumerate(cases):
                if times[i] is None:
                    continue
                try:
                    times[i].append(common.graph_ms(case[3]))
                except Exception as e:
                    traceback.print_exc(limit=3)
                    record["failures"].append(f"timing {case[0]} {m}x{n} {case[1]}: "
                                              f"{type(e).__name__}: {e}")
                    times[i] = None
        nbytes = one_pass_bytes(m, n, elem)
        for (provider, config, carveout, _, facts), ms_list in zip(cases, times, strict=True):
            if not ms_list:
                continue
            ms = sorted(ms_list)[len(ms_list) // 2]
            gbps = nbytes / (ms * 1e-3) / 1e9
            row = {"M": m, "N": n, "provider": provider, "config": config,
                   "carveout": carveout, **facts, "ms": ms, "ms_rounds": ms_list,
                   "gbps": gbps, "pct_copy": 100 * gbps / copy}
            record["rows"].append(row)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        del x, cases
        torch.cuda.empty_cache()
    if args.ncu:
        return

    print(f"\ncopy {copy:.0f} GB/s; GB/s (% of copy), median of {args.rounds} rounds")
    print(f"{'M x N':>13} {'provider':>16} {'config':>14} {'carveout':>9} {'grid':>6} "
          f"{'GB/s':>6} {'%copy':>6} {'y err':>8}")
    for r in record["rows"]:
        cute_row = r["provider"].startswith("cute")
        config = "(" + ", ".join(map(str, r["config"])) + ")" if cute_row else "-"
        carve = ("none" if r["carveout"] is None else str(r["carveout"])) if cute_row else "-"
        err = "-" if r["y_err"] is None else f"{r['y_err']:.1e}"
        grid = str(r["grid"]) if cute_row else "-"
        print(f"{r['M']:>6}x{r['N']:<6} {r['provider']:>16} {config:>14} {carve:>9} "
              f"{grid:>6} {r['gbps']:6.0f} {r['pct_copy']:5.1f}% {err:>8}")
    # The comparison #64 asks for: each shape's best of each schedule beside the peers.
    print("\nbest % of copy per shape (#64: one-shot >= 98 with persistent <= 95 names the "
          "schedule)")
    for m, n in shapes:
        best = {}
        for r in record["rows"]:
            if (r["M"], r["N"]) == (m, n) and r["pct_copy"] > best.get(r["provider"], (0,))[0]:
                carve = "none" if r["carveout"] is None else r["carveout"]
                where = f" {tuple(r['config'])} carveout {carve}" if r["config"] else ""
                best[r["provider"]] = (r["pct_copy"], where)
        print(f"{m:>6}x{n:<6} " + ", ".join(f"{p} {pct:.1f}%{where}"
                                            for p, (pct, where) in best.items()))
    for f in record["failures"]:
        print("FAILED", f)
    print(f"wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="MxN,MxN,...")
    parser.add_argument("--configs", type=json.loads,
                        help='JSON {"cols": [[threads, R, ctas_per_sm], ...]} replacing '
                             "those widths' CONFIGS (persistent and oneshot)")
    parser.add_argument("--two-pass-configs", type=json.loads,
                        help='JSON {"cols": [[threads, vectors a step, ctas_per_sm], ...]} '
                             "replacing those widths' TWO_PASS_CONFIGS")
    parser.add_argument("--carveouts", default=f"{TILENORM_CARVEOUT},none",
                        help="preferred_smem_carveout values, comma-separated; 'none' omits "
                             "it; the driver's unit is a percentage, 0-100 (default: "
                             "tilenorm's value and none)")
    parser.add_argument("--schedules", default=SCHEDULES[:2],
                        type=lambda t: list(dict.fromkeys(v.strip() for v in t.split(","))),
                        help=f"comma-separated, of {', '.join(SCHEDULES)} (default: the first "
                             "two); two_pass reads a config's R as vectors a thread a step")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--weight", choices=WEIGHT_IN, default="shared",
                        help="where a CTA keeps the weight between rows (both schedules alike)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timing rounds (every variant of a shape once a round)")
    parser.add_argument("--out", type=Path, help="JSON record (required unless "
                                                 "--compile-only)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile every variant for --arch with fake tensors (no GPU) and "
                             "print registers, stack, shared memory, spills")
    parser.add_argument("--arch", default="sm_90a", help="--compile-only's target")
    parser.add_argument("--l2-hints", default="off",
                        type=lambda t: [{"off": False, "on": True}[v.strip()]
                                        for v in t.split(",")],
                        help="off, on or off,on: the one-shot and two-pass loads with "
                             "inductor's L2 eviction policies (Variant.l2_hints)")
    parser.add_argument("--ncu", action="store_true",
                        help="no timing: each checked variant and peer launched once for "
                             "ncu --profile-from-start off (see profile_cases)")
    args = parser.parse_args()
    if set(args.schedules) - set(SCHEDULES):
        parser.error(f"--schedules: of {SCHEDULES}, got {args.schedules}")
    if not cute_launch.available():
        raise SystemExit("the CuTe DSL is missing: pip install nvidia-cutlass-dsl-libs-cu13 "
                         "apache-tvm-ffi")
    from bench import common

    shapes = common.parse_shapes(args.shapes)
    given = {int(k): [tuple(c) for c in v] for k, v in (args.configs or {}).items()}
    two_pass = {int(k): [tuple(c) for c in v] for k, v in (args.two_pass_configs or {}).items()}
    configs = {schedule: {**CONFIGS, **given} for schedule in SCHEDULES[:2]}
    configs.update({schedule: {**TWO_PASS_CONFIGS, **two_pass} for schedule in TWO_PASS})
    carveouts = [None if c.strip().lower() == "none" else int(c)
                 for c in args.carveouts.split(",")]
    planned = variants(shapes, configs, args.dtype, carveouts, args.weight, args.schedules,
                       args.l2_hints)
    if args.compile_only:
        compile_only(planned, args.arch)
        return
    if args.out is None and not args.ncu:
        parser.error("--out is required (unless --compile-only or --ncu)")
    run(args, shapes, configs, carveouts, planned)


if __name__ == "__main__":
    main()
