"""The framework-neutral launch layer: binds launch plans to the kernels of
:mod:`tilenorm.kernels` and launches them on a given stream.

    cutile.py   plans -> cuTile kernel variants, grids, compile-time arguments, operand order
    driver.py   the lean launch from raw device pointers (per-layout parameter blocks)
    cute.py     the CuTe DSL backward: compiled per plan, called through TVM-FFI
    aot.py      ahead-of-time builds of every variant for sm_90 and sm_100 (no GPU needed)
"""
