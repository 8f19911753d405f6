#!/usr/bin/env bash
# The kernels' GPU run in one call (what the README's benchmark command runs on a machine with
# the packages' src on PYTHONPATH): checks at real sizes, CUDA-graph replay of every selector,
# then the benchmark table. Results go to $OUT (or ./kernels-out). Arguments go to the bench.
# Knobs (environment): CHECK_ARGS (kernels.py check, e.g. "--check-selectors cis,cis-exact"),
# GRAPH_ARGS (decode_step.py check, e.g. "--selectors cis,prhs"), PROFILE_ARGS (a
# decode_step.py profile run when set), BENCH2_ARGS (a second bench into bench2.jsonl when set),
# TUNE_ARGS (kernels.py tune, e.g. "tune-codes --step-shapes 16x64x8"), and each part's time
# limit: CHECK_S, GRAPH_S, PROFILE_S, TUNE_S (0: no tuning), BENCH_S, BENCH2_S.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-kernels-out}
mkdir -p "$OUT"
export PYTHONPATH=packages/prhs-core/src:packages/prhs-kernels/src:packages/prhs-selectors/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
# shellcheck disable=SC2086  # the *_ARGS knobs are word lists
timeout "${CHECK_S:-200}" python benchmarks/scripts/kernels.py check ${CHECK_ARGS:-} --out "$OUT/check.jsonl" >"$OUT/check.log" 2>&1
echo "kernels check rc=$?"
# shellcheck disable=SC2086
timeout "${GRAPH_S:-150}" python benchmarks/scripts/decode_step.py check --steps "${GRAPH_STEPS:-16}" --batches "${GRAPH_BATCHES:-1,16}" ${GRAPH_ARGS:-} --out "$OUT/graph.jsonl" >"$OUT/graph.log" 2>&1
echo "graph check rc=$?"
python - "$OUT/graph.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "selector" in r:
        print(r["selector"], r["batch"], "graph==eager", r["graph_equals_eager"], "capture", r["capture_error"], "sync", r["sync_error"])
PY
if [[ -n "${PROFILE_ARGS:-}" ]]; then
    # shellcheck disable=SC2086
    timeout "${PROFILE_S:-90}" python benchmarks/scripts/decode_step.py profile ${PROFILE_ARGS} --out "$OUT/profile.jsonl" >"$OUT/profile.log" 2>&1
    echo "profile rc=$?"
fi
if [[ "${TUNE_S:-120}" != 0 ]]; then
    # shellcheck disable=SC2086
    timeout "${TUNE_S:-120}" python benchmarks/scripts/kernels.py ${TUNE_ARGS:-tune} --out "$OUT/tune.jsonl" >"$OUT/tune.log" 2>&1
    echo "tune rc=$?"
fi
timeout "${BENCH_S:-420}" python benchmarks/scripts/kernels.py bench --out "$OUT/bench.jsonl" "$@" >"$OUT/bench.log" 2>&1
echo "bench rc=$?"
if [[ -n "${BENCH2_ARGS:-}" ]]; then
    # shellcheck disable=SC2086
    timeout "${BENCH2_S:-120}" python benchmarks/scripts/kernels.py bench --out "$OUT/bench2.jsonl" ${BENCH2_ARGS} >"$OUT/bench2.log" 2>&1
    echo "bench2 rc=$?"
fi
for f in check profile tune bench bench2; do
    [[ -f "$OUT/$f.log" ]] && tail -n 5 "$OUT/$f.log" | grep -i -E "error|traceback" | head -n 3
done
python benchmarks/scripts/kernels.py table $(ls "$OUT"/check.jsonl "$OUT"/tune.jsonl "$OUT"/bench.jsonl "$OUT"/bench2.jsonl 2>/dev/null)
