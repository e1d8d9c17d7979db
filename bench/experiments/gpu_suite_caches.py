"""Build the caches the GPU suite seeds itself from, without a GPU, into the one archive the
device tool carries (bench/experiments/gpu_kit.sh unpacks it; bench/NOTES.md #115, #118):

- ``cute/``: the CuTe DSL objects of every routed variant (all dtypes) for sm_90a, which the
  host links instead of compiling (tilenorm/launch/cute_cache.py);
- ``cutile/cache.db``: cuTile's compile cache for sm_90 holding the ahead-of-time jobs
  (tilenorm/launch/aot.py, all dtypes) and the variants the GPU suite recorded
  (``gpu_suite_variants.jsonl`` beside this script: gpu_kit.sh's suite phase returns each
  part's ``cutile-variants-TAG.jsonl``; sort -u a whole suite's into it).

cuTile keys an entry by the compiler's ``--version`` text, the architecture, the optimization
level and the TileIR bytecode (cutile_cache/_cache.py, ``cache_key``), and the bytecode's
debug info names each source file by its absolute path: the kernel files and cuda.tile's own
``_stub.py`` (cuda/tile/_ir2bytecode.py, ``DebugAttrMap``). So the entries are compiled as
the GPU host compiles them: from the checkout at /work/main (the device tool puts the checkout
it sends at the same path there) by Python 3.12 with the GPU kit installed at /tmp/gpu-kit,
here as there (``bash .gpu-kit/N/install.sh`` for N = 1, 2, 3). What the folder already holds
is kept and only what is missing is built (the CuTe objects ~20 min, cuTile 1-4 s a variant
a core); what the sources no longer build is dropped.

    python bench/experiments/gpu_suite_caches.py --python ~/.pyenv/versions/3.12.1/bin/python
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from pathlib import Path

#: The checkout the device tool sends, at the same path on the GPU host.
CHECKOUT = Path("/work/main")
#: Where the GPU kit installs itself (../shared/gpu-kit/install.sh).
KIT = Path("/tmp/gpu-kit")
#: The GPU hosts' architecture (H100, H200): the DSL's target and cuTile's.
CUTE_ARCH, CUTILE_CODE = "sm_90a", "sm_90"
VARIANTS = CHECKOUT / "bench/experiments/gpu_suite_variants.jsonl"
#: The device tool's limit on what travels, the working tree included.
CARRY_LIMIT = 64 << 20


def build_cute(folder: Path) -> bool:
    """The CuTe DSL objects into ``folder``, less those of older sources; whether all built."""
    os.environ["TILENORM_CACHE_DIR"] = str(folder)
    sys.path.insert(0, str(CHECKOUT))
    from tilenorm.__main__ import build_cute_ahead_of_time, cute_builds
    from tilenorm.launch import cute, cute_cache

    if not cute.available():
        sys.exit("the CuTe DSL is not installed")
    keep = {cute_cache.variant_dir(key, CUTE_ARCH).name for key, _ in cute_builds(True)}
    for stale in [p for p in folder.glob("cute-*") if p.name not in keep]:
        shutil.rmtree(stale)
    ok = build_cute_ahead_of_time(all_dtypes=True, archs=(CUTE_ARCH,))
    size = sum(p.stat().st_size for p in folder.rglob("*.o"))
    print(f"CuTe DSL: {len(keep)} variants for {CUTE_ARCH} ({size / 2**20:.1f} MiB)", flush=True)
    return ok


def build_cutile(folder: Path, python: str, workers: int) -> int:
    """cuTile's cache in ``folder``, compiled by the kit's ``python`` (:func:`cutile_child`),
    less the entries this build did not look up; returns the child's exit status."""
    if not (KIT / "env.sh").exists():
        sys.exit(f"the GPU kit is not installed at {KIT}: bash .gpu-kit/N/install.sh for N = 1, "
                 "2, 3")
    import typing_extensions  # cuda.tile's one dependency, which the kit leaves to the host

    with tempfile.TemporaryDirectory() as extra:
        shutil.copy(typing_extensions.__file__, extra)
        env = {**os.environ, "CUDA_TILE_CACHE_DIR": str(folder),
               "PYTHONPATH": f"{KIT / 'site'}:{extra}",
               "PATH": f"{KIT / 'toolchain/bin'}:{os.environ['PATH']}"}
        start = time.time()
        status = subprocess.run([python, __file__, "--cutile-child", str(workers)], env=env,
                                check=False).returncode
    if status == 0:  # a lookup or a store stamps an entry's atime
        db = sqlite3.connect(folder / "cache.db")
        dropped = db.execute("delete from cache where atime < ?", (start,)).rowcount
        db.commit()
        db.close()
        print(f"cuTile: {dropped} entries of older sources dropped", flush=True)
    return status


_JOBS: list = []


def _export(i: int) -> None:
    from tilenorm.launch.aot import export

    job, gpu_code = _JOBS[i]
    export(job, gpu_code)


def cutile_child(workers: int) -> None:
    """In the kit's Python: every job into $CUDA_TILE_CACHE_DIR, ``workers`` at a time."""
    import cuda.tile

    if sys.version_info[:2] != (3, 12) or not cuda.tile.__file__.startswith(f"{KIT}/site/"):
        sys.exit(f"cuTile's entries must be built by Python 3.12 on the kit in {KIT} (this is "
                 f"Python {sys.version.split()[0]}, cuda.tile from {cuda.tile.__file__})")
    # The package's __init__ imports torch and the frontends, which the kernels, their plans
    # and bindings do not need (nor does the kit's Python have them here).
    package = types.ModuleType("tilenorm")
    package.__path__ = [str(CHECKOUT / "tilenorm")]
    sys.modules["tilenorm"] = package
    from tilenorm.launch import aot

    jobs = {(id(job.kernel), job.signature.symbol, CUTILE_CODE): (job, CUTILE_CODE)
            for job in aot.jobs()}
    ahead, stale = len(jobs), 0
    lines = VARIANTS.read_text().splitlines() if VARIANTS.exists() else []
    for line in filter(None, lines):
        try:
            job, gpu_code = aot.recorded_job(line)
        except (AttributeError, ImportError, KeyError):
            stale += 1
            continue
        jobs.setdefault((id(job.kernel), job.signature.symbol, gpu_code), (job, gpu_code))
    _JOBS.extend(jobs.values())
    print(f"cuTile: {ahead} ahead-of-time jobs for {CUTILE_CODE}, {len(_JOBS) - ahead} more of "
          f"{len(lines)} recorded variants ({VARIANTS.name}; {stale} name kernels gone), "
          f"{workers} at a time", flush=True)
    start, failed = time.perf_counter(), 0
    fork = multiprocessing.get_context("fork")  # the workers inherit the jobs
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=fork) as pool:
        futures = {pool.submit(_export, i): i for i in range(len(_JOBS))}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            try:
                future.result()
            except Exception as error:  # the compiler's errors are cuTile's own classes
                failed += 1
                print(f"FAILED {_JOBS[futures[future]][0].label}: {error}", flush=True)
            if done % 100 == 0:
                print(f"  {done} of {len(_JOBS)} in {time.perf_counter() - start:.0f} s",
                      flush=True)
    print(f"cuTile: {len(_JOBS) - failed} entries in {time.perf_counter() - start:.0f} s, "
          f"{failed} failed", flush=True)
    sys.exit(1 if failed else 0)


def pack(folder: Path, archive: Path) -> None:
    """``folder``'s cute/ and cutile/cache.db into the xz tar ``archive`` (gpu_kit.sh needs
    only the GPU host's tar and xz)."""
    db = sqlite3.connect(folder / "cutile/cache.db")
    entries = db.execute("select count(*) from cache").fetchone()[0]
    db.execute("vacuum")
    db.close()
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:xz", preset=9) as tar:
        tar.add(folder / "cute", "cute")
        tar.add(folder / "cutile/cache.db", "cutile/cache.db")
    os.replace(tmp, archive)
    size = archive.stat().st_size
    objects = len(list((folder / "cute").iterdir()))
    print(f"{archive}: {objects} CuTe objects and {entries} cuTile entries in "
          f"{size / 2**20:.1f} MiB (the device tool carries {CARRY_LIMIT >> 20} MiB, the "
          f"working tree included)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default="python3.12",
                        help="a Python 3.12 for the kit (default: python3.12)")
    parser.add_argument("--folder", type=Path, default=CHECKOUT / ".gpu-cache/suite",
                        help="where the caches are built (kept between builds)")
    parser.add_argument("--archive", type=Path,
                        default=CHECKOUT / ".gpu-cache/suite-caches.tar.xz")
    parser.add_argument("--workers", type=int, default=os.cpu_count(),
                        help="cuTile compiles at a time")
    parser.add_argument("--cutile-child", type=int, metavar="WORKERS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cutile_child:
        cutile_child(args.cutile_child)
    folder = args.folder.resolve()
    ok = build_cute(folder / "cute")
    status = build_cutile(folder / "cutile", args.python, args.workers)
    pack(folder, args.archive.resolve())
    sys.exit(0 if ok and status == 0 else 1)


if __name__ == "__main__":
    main()
