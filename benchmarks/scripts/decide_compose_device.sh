# The CIS decision writing the reusing rows' selections (cis_decide_compose), on the device in one call:
# the GPU check of the launches against the torch ops, then Table V points A/B'd against the packages
# of an earlier commit (ab/<C>/, extracted first: see tuning_ab_device.sh).
# Usage: BASE=<commit> bash benchmarks/scripts/decide_compose_device.sh
set -e
export PYTHONPATH=$PWD/packages/prhs-core/src:$PWD/packages/prhs-kernels/src:$PWD/packages/prhs-selectors/src:$PWD/packages/prhs-eval/src
python benchmarks/scripts/decide_compose_check.py 2>&1 | tee $OUT/decide_compose_check.txt
POINTS=${POINTS:-"llama3-8b:8:4096:CIS llama2-7b:1:4096:CIS llama3-8b:16:16384:CIS"} VARIANTS="at${BASE:-fe28295} base" \
    bash benchmarks/scripts/tuning_ab_device.sh > $OUT/ab.log 2>&1 || tail -30 $OUT/ab.log
python - "$OUT/all-rows.jsonl" <<'PY' | tee $OUT/ab.txt
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["variant"], r["shape"], r["batch"], r["context"], round(r["ms_per_step"], 3),
          round(r["ms_median"], 3), round(r["vs_floor"], 3))
PY
(cd "$OUT" && tar czf ab-folders.tgz --exclude='*.tgz' */ && rm -rf -- */)
