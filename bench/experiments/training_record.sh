#!/usr/bin/env bash
# One device call of issue 17's training record, a record that takes several calls (every
# model, size and mode: ~25 minutes on an H100, NOTES.md #49). From the repository root on
# the GPU host, once the wheelhouse is joined in /tmp/wheelhouse (.ci/gpu-wheelhouse.sh):
#   COMMIT=<sha> bash bench/experiments/training_record.sh RECORD [BUDGET_S] [bench args...]
# RECORD: the record so far, a path in the working tree that travels with the call (a
# tracked file, or a git-ignored one named in the call's carry); absent on the first call.
# The call copies it to $OUT/training.json, runs only the model/size/modes it lacks
# (--missing) within BUDGET_S (default 480) and leaves the grown record there with its plot.
# Here, copy $OUT's training.json over RECORD and call again until the log says every group
# is recorded; `python bench/bench_training.py --report RECORD` then replots it.
set -uo pipefail
: "${OUT:?run through the device tool}" "${COMMIT:?set COMMIT to the commit under test}"
record=${1:?the record so far (a path that need not exist yet)}
budget=${2:-480}
shift $(( $# < 2 ? $# : 2 ))
export PYTHONUNBUFFERED=1 CUDA_TILE_CACHE_DIR=/tmp/cutile-cache TILENORM_COMMIT=$COMMIT
bash .ci/gpu-install || exit 1
# Timing the reference path instead of the kernels would be a wasted call: say so first.
python3 -m tilenorm validation status
[ -f "$record" ] && cp "$record" "$OUT/training.json"
timeout $((budget + 90)) python3 bench/bench_training.py --out "$OUT/training.json" --missing \
  --budget-s "$budget" --plot "$@" > "$OUT/training.log" 2>&1
echo "bench_training exit $? (124: cut at $((budget + 90)) s)"
grep -E "^\[" "$OUT/training.log" | grep -E "recorded|skipped|FAILED|absent" | tail -20
grep -E "fastest|<= torch|FAIL" "$OUT/training.log" | tail -30
