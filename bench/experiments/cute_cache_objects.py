"""Build the CuTe DSL objects of every routed variant (all dtypes) for one architecture into a
cache folder, without a GPU, for a GPU host to link instead of compiling
(tilenorm/launch/cute_cache.py; bench/NOTES.md #115). The GPU suite carries the folder
(``carry``) and points ``TILENORM_CACHE_DIR`` at it.

    python bench/experiments/cute_cache_objects.py sm_90a .gpu-cache/cute
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arch", help="the DSL's --gpu-arch, e.g. sm_90a")
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    os.environ["TILENORM_CACHE_DIR"] = str(args.folder.resolve())
    from tilenorm.__main__ import cute_builds
    from tilenorm.launch import cute, cute_cache

    if not cute.available():
        sys.exit("the CuTe DSL is not installed")
    builds = cute_builds(all_dtypes=True)
    start, failed = time.perf_counter(), 0
    for i, (key, compile_kernel) in enumerate(builds, 1):
        try:
            cute_cache.build_object(key, args.arch, compile_kernel)
        except RuntimeError as error:
            failed += 1
            print(f"FAILED {key}: {error}", flush=True)
        if i % 50 == 0:
            print(f"{i} of {len(builds)} in {time.perf_counter() - start:.0f} s", flush=True)
    size = sum(p.stat().st_size for p in args.folder.rglob("*.o"))
    print(f"{len(builds) - failed} objects for {args.arch} ({size / 2**20:.1f} MiB) in "
          f"{time.perf_counter() - start:.0f} s, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
