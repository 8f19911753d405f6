# Programmatic dependent launch (prhs_kernels.pdl) on the device in one call: the CIS launches' GPU
# check with and without PDL (checked against the torch ops, then a reuse step's launches timed back
# to back), the sparse kernel checked and timed alone (shipped / PDL), then Table V points A/B'd
# within what is left of ~9 minutes (tuning_ab_device.sh variants).
# Usage: [POINTS=...] [VARIANTS=...] [BUDGET_S=540] [CHECK_PDL="1 0"] bash benchmarks/scripts/pdl_device.sh
set -e
export PYTHONPATH=$PWD/packages/prhs-core/src:$PWD/packages/prhs-kernels/src:$PWD/packages/prhs-selectors/src:$PWD/packages/prhs-eval/src
start=$SECONDS
python -c "import torch, triton; from prhs_kernels.pdl import pdl_supported as s; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, 'pdl supported:', s('cuda'))"
mkdir -p $OUT/raw
for pdl in ${CHECK_PDL:-1 0}; do
    PRHS_PDL=$pdl python benchmarks/scripts/decide_compose_check.py > $OUT/raw/check-pdl$pdl.txt 2>&1 || true
    echo "== decide_compose_check PRHS_PDL=$pdl"; tail -14 $OUT/raw/check-pdl$pdl.txt
done
shapes=1:32:8:contig,1:8:8:contig,8:8:8:contig,8:32:8:contig,16:8:8:contig
for run in "shipped:0:" "pdl:1:"; do
    IFS=: read -r name pdl extra <<< "$run"
    PRHS_PDL=$pdl python benchmarks/scripts/sparse_probe.py --shipped-only $extra --shapes $shapes \
        --out $OUT/raw/probe-$name.jsonl 2>&1 | grep "^B" | sed "s/^/$name /" || true
done
python - $OUT/raw/probe-*.jsonl <<'PY'
import json, sys
for f in sys.argv[1:]:
    for line in open(f):
        r = json.loads(line)
        if r.get("part") == "probe" and "rel_err" in r:
            print(f.split("probe-")[1][:-6], r["B"], r["Hkv"], "rel_err", f'{r["rel_err"]:.2e}', "lse_err", f'{r["lse_err"]:.2e}', "written", r["written"])
PY
left=$(( ${BUDGET_S:-540} - (SECONDS - start) ))
echo "== Table V A/B, $left s left"
POINTS=${POINTS:-"llama3-8b:8:4096:CIS llama2-7b:1:4096:CIS"} VARIANTS=${VARIANTS:-"base pdl"} \
    timeout $left bash benchmarks/scripts/tuning_ab_device.sh > $OUT/raw/ab.log 2>&1 || tail -5 $OUT/raw/ab.log
[ -f $OUT/all-rows.jsonl ] && mv $OUT/all-rows.jsonl $OUT/raw/
python - "$OUT/raw/all-rows.jsonl" <<'PY' | tee $OUT/ab.txt
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["variant"], r["shape"], r["batch"], r["context"], round(r["ms_per_step"], 3),
          round(r["ms_median"], 3), round(r["vs_floor"], 3), round(r.get("avg_selected") or 0, 2))
PY
(cd "$OUT" && tar czf results.tgz --exclude='*.tgz' raw */ 2>/dev/null; rm -rf -- */)
