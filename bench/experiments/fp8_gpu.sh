#!/usr/bin/env bash
# Issue 19 in device calls, from the repository root on the GPU host, once the wheelhouse is
# joined in /tmp/wheelhouse (.ci/gpu-wheelhouse.sh):
#   COMMIT=<sha> bash bench/experiments/fp8_gpu.sh tests
#       the FP8 family's GPU tests (tests/test_fp8.py -m gpu) and their validation summary,
#       $OUT/gpu-tests-fp8.json (`python -m tilenorm validation record S --family
#       cutile/norm-fp8` here)
#   COMMIT=<sha> bash bench/experiments/fp8_gpu.sh bench RECORD CASES [BUDGET_S]
#       bench_fp8.py over CASES (its --scalings) into $OUT/fp8.json, starting from RECORD (a
#       path that travels with the call; absent on the first call) so that a record can grow
#       over several calls; then `python bench/bench_fp8.py --report` here replots it.
set -uo pipefail
: "${OUT:?run through the device tool}" "${COMMIT:?set COMMIT to the commit under test}"
export PYTHONUNBUFFERED=1 CUDA_TILE_CACHE_DIR=/tmp/cutile-cache TILENORM_COMMIT=$COMMIT
export TILENORM_EXPERIMENTAL=1  # what this run validates
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader
bash .ci/gpu-install || exit 1
case ${1:?tests or bench} in
  tests)
    start=$SECONDS
    timeout 540 python3 -m pytest -m gpu -n 8 --dist loadgroup -q -p no:cacheprovider \
      tests/test_fp8.py --junitxml="$OUT/junit-fp8.xml" > "$OUT/pytest-fp8.log" 2>&1
    echo "pytest exit $? in $((SECONDS - start)) s"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest-fp8.log" | head -30
    tail -3 "$OUT/pytest-fp8.log"
    python3 -m tilenorm validation summarize --junit "$OUT/junit-fp8.xml" --commit "$COMMIT" \
      --markers "gpu, tests/test_fp8.py" --out "$OUT/gpu-tests-fp8.json" > /dev/null ;;
  bench)
    record=${2:?the record so far (a path that need not exist yet)}
    cases=${3:?bench_fp8 cases}
    budget=${4:-540}
    [ -f "$record" ] && cp "$record" "$OUT/fp8.json"
    timeout "$budget" python3 bench/bench_fp8.py --experimental --scalings "$cases" \
      --out "$OUT/fp8.json" > "$OUT/bench-fp8-$(date +%H%M%S).log" 2>&1
    echo "bench_fp8 exit $? (124: cut at $budget s)"
    tail -40 "$OUT"/bench-fp8-*.log ;;
esac
