# The sparse kernel's software pipelining on the device, in one call: the launch plans probed at
# the CIS-8 shapes of Table V (every plan timed back to back), then the fastest plan at each
# point's shape A/B'd against the shipped one on that Table V point (tuning_ab_device.sh).
# Usage: PRHS_COMMIT=<sha> [PLANS=...] [POINTS=...] bash benchmarks/scripts/sparse_stages_device.sh
set -e
export PYTHONPATH=$PWD/packages/prhs-core/src:$PWD/packages/prhs-kernels/src:$PWD/packages/prhs-selectors/src:$PWD/packages/prhs-eval/src
PLANS=${PLANS:-64:4:2:4,64:4:3:3,64:4:3:4,64:4:4:2,32:4:3:4,32:4:4:4,32:4:3:6,32:2:3:8,128:8:2:2,128:8:3:2,64:8:3:3}
# (B:Hkv:s:layout of each point's decode: Llama-3-8B B8 / B16 / B1, Llama-2-7B B1 / B8)
SHAPES=${SHAPES:-8:8:8:contig,16:8:8:contig,1:8:8:contig,1:32:8:contig,8:32:8:contig}
python benchmarks/scripts/sparse_probe.py --plans "$PLANS" --b2b-all --budget 1536 \
    --shapes "$SHAPES" --out "$OUT/probe.jsonl" 2>&1 | grep -v "Warning\|warn" | tail -n 30
# The fastest plan at a shape as a tuning_ab variant (bnN+nwN+nsN+wN), or base if it is shipped.
best() {
    python - "$OUT/probe.jsonl" "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
b, hkv = (int(v) for v in sys.argv[2].split(":"))
ok = [r for r in rows if r.get("B") == b and r.get("Hkv") == hkv and "b2b_ms" in r
      and r.get("rel_err", 1) < 1e-2]
r = min(ok, key=lambda r: r["b2b_ms"])
plan = (r["block_n"], r["num_warps"], r["num_stages"], r["waves"])
print("base" if plan == (64, 4, 2, 4) else "bn%d+nw%d+ns%d+w%d" % plan)
PY
}
points=""
variants=""
for p in ${POINTS:-llama3-8b:8:4096:8:8 llama2-7b:1:4096:1:32}; do
    IFS=: read -r shape batch context b hkv <<< "$p"
    v=$(best "$b:$hkv")
    echo "fastest plan at B$b Hkv$hkv: $v"
    POINTS="$shape:$batch:$context:CIS" VARIANTS="base $v" OUT=$OUT \
        bash benchmarks/scripts/tuning_ab_device.sh
done
python - "$OUT/all-rows.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["variant"], r["shape"], r["batch"], r["context"], round(r["ms_per_step"], 3),
          round(r["ms_median"], 3), round(r["vs_floor"], 3))
PY
# (at most 8 files come back: the per-variant folders travel as one archive)
(cd "$OUT" && tar czf ab-folders.tgz --exclude='*.tgz' */ && rm -rf -- */)
