#!/usr/bin/env bash
# Device calls through the GPU kit (../shared/gpu-kit: cuTile, its CUDA 13.4 compiler, the
# CuTe DSL and the peers), from the repository root on the GPU host. A fresh machine first
# takes the kit's three parts, one call each (carry ".gpu-kit/N", `bash .gpu-kit/N/install.sh`),
# re-split first by gpu_kit_split.sh: a 60 MB part of pack.sh's and this tree exceed the
# 64 MiB carry, a 50 MB one does not (NOTES #122); the third (35 MB) shares a call with
# this script where no archive travels beside it (the suite archive is 33 MiB). Then, per
# call (carry
# ".gpu-cache/suite-caches.tar.xz" where it was built: bench/experiments/gpu_suite_caches.py):
#   bash bench/experiments/gpu_kit.sh COMMIT PHASE [LIMIT_S [args...]]
# PHASE, each writing its JSON and log to $OUT:
#   sweep SHAPES          bench_rms_norm.py over SHAPES (MxN,...; "narrow" / "wide" name the
#                         sweep's halves: ~2 / ~3.5 min on an H200) beside every peer
#   ops                   bench_norm_ops.py, every op at 32768x4096 and 4096x65536 (~3 min)
#   fp8 [SHAPES [CASES]]  bench_fp8.py, its default shapes and scalings (~2.5 min on an H100,
#                         ~4 on an H200, NOTES #113) or those given
#   jax                   bench_jax.py with profiled kernel time (~2.5 min)
#   dtype DTYPE [SHAPES]  the sweep (or SHAPES) in float16 or float32 beside Quack, Liger,
#                         torch.compile
#   variants FILE         each case of a variants file (bench/experiments/variants/*.json:
#                         {"cases": [{"tool", "ops" or "scalings", "shapes", ["dtype"],
#                         "variants", ["kernel_times": true: bench_fp8's --kernel-times],
#                         ["modes": bench_norm_ops's, default "graph"]}]}; a variant's
#                         "patch" sets module attributes: bench/tune_norm.py PATCH),
#                         case i into $OUT/NAME-i.json (NAME the file's, no .json)
#   suite TAG PATHS...    the GPU tests (-m gpu) of PATHS with $WORKERS xdist workers (default
#                         3; 5 ran out of an H100's 80 GB: NOTES #65, #99), JAX allocating as
#                         it goes. JUnit files stay in /tmp/suite for the machine's life, so a
#                         suite spans calls, and come back in $OUT/junit; the cuTile variants
#                         the tests compiled in $OUT/cutile-variants-TAG.jsonl (sort -u a whole
#                         suite's into bench/experiments/gpu_suite_variants.jsonl). On an H100, 3
#                         workers (NOTES #99): test_cute_forward + test_cute_cluster_backward
#                         2 min, the other torch tests 6.2 min, test_fp8 6.2 min (4 workers),
#                         JAX's two files 1 min (5 workers)
#   summarize             the validation summary of every JUnit file in /tmp/suite:
#                         $OUT/gpu-tests.json, for `python -m tilenorm validation record` here
# LIMIT_S (default 540; given whenever args follow) bounds each tool run; a run cut short
# keeps what it measured. E.g. `... gpu_kit.sh 5709815 suite 540 fp8 tests/test_fp8.py`.
# TILENORM_EXPERIMENTAL=1 where the sources under test are not yet validated (a suite sets it).
set -uo pipefail
: "${OUT:?run through the device tool}"
commit=${1:?commit under test}
phase=${2:?phase}
limit=${3:-540}
shift $(( $# < 3 ? $# : 3 ))
source /tmp/gpu-kit/env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 CUDA_TILE_CACHE_DIR=/tmp/cutile-cache \
  TILENORM_CACHE_DIR=/tmp/tilenorm-cache TILENORM_COMMIT=$commit
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
# The caches built without a GPU (bench/experiments/gpu_suite_caches.py, carried as
# .gpu-cache/suite-caches.tar.xz), seeded once a machine and archive: the CuTe DSL objects,
# linked here instead of compiled (NOTES #115), and cuTile's compiles, found in its cache
# (NOTES #118; the first seeding's time, seeded-at, tells them from this machine's compiles).
if [ -f .gpu-cache/suite-caches.tar.xz ]; then
  sum=$(sha256sum .gpu-cache/suite-caches.tar.xz | cut -c1-16)
  if [ "$(cat /tmp/suite-caches/sum 2>/dev/null)" != "$sum" ]; then
    rm -rf /tmp/suite-caches && mkdir -p /tmp/suite-caches "$TILENORM_CACHE_DIR"
    tar -C /tmp/suite-caches -xJf .gpu-cache/suite-caches.tar.xz
    cp -rn /tmp/suite-caches/cute/. "$TILENORM_CACHE_DIR"/
    python3 - <<'EOF'
import os, shutil, sqlite3
seed, db = "/tmp/suite-caches/cutile/cache.db", "/tmp/cutile-cache/cache.db"
if os.path.exists(db):
    con = sqlite3.connect(db)
    con.execute("attach ? as seed", (seed,))
    con.execute("insert or ignore into cache (key, blob, blob_size, atime, metadata) "
                "select key, blob, blob_size, atime, metadata from seed.cache")
    con.commit()
else:
    os.makedirs(os.path.dirname(db), exist_ok=True)
    shutil.copy(seed, db)
n = sqlite3.connect(seed).execute("select count(*) from cache").fetchone()[0]
print(f"seeded: {len(os.listdir('/tmp/suite-caches/cute'))} CuTe objects, {n} cuTile entries")
EOF
    rm -f /tmp/suite-caches/cutile/cache.db && echo "$sum" > /tmp/suite-caches/sum
    [ -e /tmp/cutile-cache/seeded-at ] || touch /tmp/cutile-cache/seeded-at
  fi
fi
NARROW=1048576x128,524288x256,262144x512,131072x1024,65536x2048,32768x128,4096x4096
WIDE=32768x4096,26214x5120,18724x7168,16384x8192,8192x16384,4096x32768,2048x65536,1024x131072

run() {  # run NAME SCRIPT ARGS...: one tool run into $OUT/NAME.json and NAME.log
  local name=$1
  shift
  timeout "$limit" python3 "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name exit $? (124: cut at $limit s)"
  tail -45 "$OUT/$name.log"
}

case $phase in
  sweep)
    shapes=${1:?shapes}
    [ "$shapes" = narrow ] && shapes=$NARROW
    [ "$shapes" = wide ] && shapes=$WIDE
    run "sweep-$(date +%H%M%S)" bench/bench_rms_norm.py --shapes "$shapes" ;;
  ops) run ops bench/bench_norm_ops.py --shapes 32768x4096,4096x65536 ;;
  fp8) run "fp8-$(date +%H%M%S)" bench/bench_fp8.py ${1:+--shapes "$1"} ${2:+--scalings "$2"} ;;
  jax) XLA_PYTHON_CLIENT_PREALLOCATE=false run jax bench/bench_jax.py ;;
  dtype)
    run "sweep-${1:?dtype}" bench/bench_rms_norm.py --dtype "$1" --modes graph \
      --providers tilenorm,quack,liger,torch.compile ${2:+--shapes "$2"} ;;
  variants)
    file=${1:?variants file}
    n=$(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))['cases']))" "$file")
    for ((i = 0; i < n; i++)); do
      mapfile -t argv < <(python3 - "$file" "$i" <<'EOF'
import json
import sys

case = json.load(open(sys.argv[1]))["cases"][int(sys.argv[2])]
tool = case.get("tool", "bench_norm_ops")
print(f"bench/{tool}.py")
for key in ("ops", "scalings", "shapes", "cases", "dtype"):
    if key in case:
        print(f"--{key}")
        print(case[key])
if tool == "bench_norm_ops":
    print("--modes")
    print(case.get("modes", "graph"))
if case.get("kernel_times"):
    print("--kernel-times")
if tool != "tune_norm":  # tune_norm launches the kernels itself, validated or not
    print("--experimental")
print("--variants")
print(json.dumps(case["variants"]))
EOF
      )
      # named by the file, so that several files in one call keep their JSONs
      run "$(basename "$file" .json)-$i" "${argv[@]}"
    done ;;
  suite)
    tag=${1:?tag}
    shift
    # the cuTile variants the tests compile, for the CPU's next build of the caches (NOTES #118)
    export TILENORM_EXPERIMENTAL=1 TILENORM_CUTILE_RECORD=/tmp/suite/cutile-variants-$tag.jsonl
    mkdir -p /tmp/suite
    start=$SECONDS
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$limit" python3 -m pytest -m gpu \
      -n "${WORKERS:-3}" --dist loadgroup -q -p no:cacheprovider "$@" \
      --junitxml="/tmp/suite/junit-$tag.xml" > "$OUT/pytest-$tag.log" 2>&1
    echo "pytest $tag exit $? in $((SECONDS - start)) s (124: cut at $limit s, no JUnit)"
    # the JUnit file comes back too: a machine given back loses /tmp/suite, and with it a
    # suite spanning machines (carry the files back into /tmp/suite to summarize them)
    mkdir -p "$OUT/junit" && cp -f "/tmp/suite/junit-$tag.xml" "$OUT/junit/" 2>/dev/null
    grep -E "^(FAILED|ERROR)" "$OUT/pytest-$tag.log" | head -30
    sort -u "$TILENORM_CUTILE_RECORD" -o "$OUT/cutile-variants-$tag.jsonl" 2>/dev/null &&
      echo "cuTile variants recorded: $(wc -l < "$OUT/cutile-variants-$tag.jsonl")"
    # what the suite so far spent in cuTile's compiler (its cache keeps each compile's time),
    # and how many of the seeded entries it found
    python3 - <<'EOF'
import json, os, sqlite3
mark = "/tmp/cutile-cache/seeded-at"
seeded = os.path.getmtime(mark) if os.path.exists(mark) else 0.0
try:
    rows = sqlite3.connect("/tmp/cutile-cache/cache.db").execute(
        "select atime, metadata from cache").fetchall()
except sqlite3.Error as e:
    rows = []
    print(f"cuTile compile cache unreadable: {e}")
made = [(atime, meta.get("compilation_timestamp") or 0, meta.get("compilation_time_seconds") or 0)
        for atime, meta in ((atime, json.loads(m or "{}")) for atime, m in rows)]
here = [seconds for _, when, seconds in made if when > seeded]
found = sum(atime > seeded for atime, when, _ in made if when <= seeded)
print(f"cuTile compiles so far: {len(here)}, {sum(here):.0f} s of compiler time; seeded "
      f"entries found: {found} of {len(made) - len(here)}")
EOF
    tail -2 "$OUT/pytest-$tag.log"
    ls /tmp/suite ;;
  summarize)
    junits=()
    for f in /tmp/suite/junit-*.xml; do junits+=(--junit "$f"); done
    python3 -m tilenorm validation summarize "${junits[@]}" --commit "$commit" --markers gpu \
      --out "$OUT/gpu-tests.json"
    cat "$OUT/gpu-tests.json" ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
