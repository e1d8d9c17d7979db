"""What a process pays to get its CuTe DSL kernels (bench/NOTES.md #115): the DSL's import,
then loading a dozen routed variants through the disk cache (tilenorm/launch/cute_cache.py)
for sm_90a. Run it twice on one cache: the first run compiles, exports and links each
variant, the second loads them. No GPU needed.

    TILENORM_CACHE_DIR=/tmp/cache python bench/experiments/cute_cache_startup.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    start = time.perf_counter()
    from tilenorm.launch import cute, cute_cache

    if not cute.available():
        sys.exit("the CuTe DSL is not installed")
    import cutlass.cute  # noqa: F401  (the import a compile needs, timed here)

    imported = time.perf_counter()
    variants = ([(k, cute.compile_forward) for k in cute.aot_forward_keys()[:6]]
                + [(k, cute.compile_cluster_backward)
                   for k in cute.aot_cluster_backward_keys()[:3]]
                + [(k, cute.compile_fp8_forward) for k in cute.aot_fp8_keys()[:3]])
    seconds = []
    for key, compile_kernel in variants:
        t = time.perf_counter()
        cute_cache.load(key, (9, 0), compile_kernel)
        seconds.append(time.perf_counter() - t)
    print(f"import {imported - start:.1f} s; {len(variants)} variants {sum(seconds):.2f} s "
          f"(each {min(seconds) * 1e3:.0f}-{max(seconds) * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
