"""What the CuTe DSL row kernels (cute_row_norm_forward.py, cute_row_norm_backward.py,
cute_row_norm_fp8.py) share: how a thread's elements of a row are laid out, and the launch's
shared-memory carveout."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

#: The launch's preferred shared-memory carveout, a percentage of the unified L1 and shared
#: memory (CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT): -1 states no preference, so
#: the driver sizes it for the occupancy the kernel asks. Given so that the compile does not
#: query a device (it also runs on CPUs), as the DSL would to choose one; the carveout moves
#: no timing (#65).
SMEM_CARVEOUT = -1


def ring_copies(dtype) -> tuple:
    """The ``cp.async`` atoms that fill a ring in shared memory (bench/NOTES.md #132): a
    row's 16-byte vectors of ``dtype`` by ``.cg`` (streamed once, past L1, which the
    carveout leaves small) and a row's fp32 scalars by ``.ca`` (cp.async's only mode under
    16 bytes)."""
    return (cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                dtype, num_bits_per_copy=128),
            cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.ALWAYS),
                                Float32, num_bits_per_copy=32))


class RowKernel:
    """A kernel whose ``threads`` threads each hold ``vec``-element (16-byte) vectors of a
    row."""

    vec: int
    threads: int

    def _whole_vectors(self, cols: int) -> int:
        """The vectors a thread holds of a ``cols``-wide row (``vec`` and ``threads`` set),
        or refuse a row that is not whole vectors of the threads."""
        if cols % (self.vec * self.threads):
            raise ValueError(f"{cols} columns are not whole {self.vec}-element vectors of "
                             f"{self.threads} threads")
        return cols // (self.vec * self.threads)

    @cute.jit
    def _thread_view(self, row: cute.Tensor, tidx: Int32) -> cute.Tensor:
        """This thread's (vec, reps) elements of a row: one vector per rep, the reps
        ``threads`` vectors apart, so a warp's access is 32 contiguous vectors."""
        vectors = cute.zipped_divide(row, (self.vec,))
        blocks = cute.logical_divide(vectors, (None, self.threads))
        return blocks[(None, (tidx, None))]
