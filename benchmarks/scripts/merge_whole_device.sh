# The sparse kernel's merge in the last slice with whole loads (TUNING["merge_whole"]), on the
# device in one call: the CIS launches' GPU check, the kernel alone at CIS-8's shapes (merge launch /
# last slice slice-by-slice / last slice whole), then Table V points A/B'd (tuning_ab_device.sh
# variants: base, mlN+mw, and atC for an earlier commit's packages under ab/C/).
# Usage: [POINTS=...] [VARIANTS=...] bash benchmarks/scripts/merge_whole_device.sh
set -e
export PYTHONPATH=$PWD/packages/prhs-core/src:$PWD/packages/prhs-kernels/src:$PWD/packages/prhs-selectors/src:$PWD/packages/prhs-eval/src
if [ -z "$SKIP_CHECK" ]; then
    python benchmarks/scripts/decide_compose_check.py > $OUT/decide_compose_check.txt 2>&1 || true
    tail -12 $OUT/decide_compose_check.txt
fi
shapes=1:32:8:contig,1:8:8:contig,8:8:8:contig,8:32:8:contig,16:8:8:contig
for run in "launch:--merge-last 0" "loop:--merge-last 1024" "whole:--merge-last 1024 --merge-whole"; do
    python benchmarks/scripts/sparse_probe.py --shipped-only ${run#*:} --shapes $shapes \
        --out $OUT/probe-${run%%:*}.jsonl 2>&1 | grep "^B" | sed "s/^/${run%%:*} /"
done
POINTS=${POINTS:-"llama2-7b:1:4096:CIS llama3-8b:8:4096:CIS"} VARIANTS=${VARIANTS:-"base ml16+mw mw"} \
    bash benchmarks/scripts/tuning_ab_device.sh > $OUT/ab.log 2>&1 || tail -30 $OUT/ab.log
python - "$OUT/all-rows.jsonl" <<'PY' | tee $OUT/ab.txt
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["variant"], r["shape"], r["batch"], r["context"], round(r["ms_per_step"], 3),
          round(r["ms_median"], 3), round(r["vs_floor"], 3))
PY
(cd "$OUT" && tar czf ab-folders.tgz --exclude='*.tgz' */ && rm -rf -- */)
