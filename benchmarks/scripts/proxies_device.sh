#!/usr/bin/env bash
# The proxy scorers on one GPU (Double Sparsity / HShare label scoring, RaBitQ binary x 4-bit
# estimates, CompKV block statistics, Louver's cluster scan and index build): each Triton kernel
# against its torch reference at real sizes on every layout, the selectors' Triton step against
# their torch step, CUDA-graph replay equals eager, then step timings against dense attention,
# oracle and Quest (budget 1024, Hq 32, Hkv 8, D 128, bf16). SEL=louver,... picks the selectors
# of the graph and timing parts. Run from the repo root.
set -uo pipefail
OUT=${OUT:-proxies-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/packages/prhs-core/src:$PWD/packages/prhs-kernels/src:$PWD/packages/prhs-selectors/src
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
SEL=${SEL:-double_sparsity,double_sparsity-table,hshare,hshare-table,rabitq,compkv,louver}
python benchmarks/scripts/kernels.py check-proxies --out "$OUT/check.jsonl" > "$OUT/check.log" 2>&1
echo "check rc=$?"
python benchmarks/scripts/decode_step.py check --selectors "$SEL" --batches 1,16 --steps 16 --out "$OUT/graph.jsonl" > "$OUT/graph.log" 2>&1
echo "graph rc=$?"
python benchmarks/scripts/decode_step.py bench --selectors "oracle,quest,$SEL" --shapes "${SHAPES:-1x16,16x16,16x64}" --budget 1024 --out "$OUT/bench.jsonl" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
tail -n 3 "$OUT"/*.log | grep -i -E "error|traceback" | head -n 5
python - "$OUT" <<'PY'
import json, sys
d = sys.argv[1]
for f in ("check", "graph", "bench"):
    try:
        rows = [json.loads(x) for x in open(f"{d}/{f}.jsonl")]
    except OSError:
        continue
    for r in rows:
        if r.get("part") == "machine":
            print(r)
        elif r.get("part") == "check" and "op" in r:
            print({k: r.get(k) for k in ("op", "path", "paths", "dtype", "layout", "hq/hkv", "rel_err", "max_abs_err", "inf_equal", "equal_selections", "max_out_rel_diff")})
        elif "selector" in r and r.get("part") == "check":
            print(r["selector"], r["batch"], "graph==eager", r["graph_equals_eager"], r["max_abs_diff"], r["capture_error"], r["sync_error"])
        elif r.get("part") == "bench":
            print({k: (round(r[k], 4) if isinstance(r.get(k), float) else r.get(k)) for k in ("selector", "shape", "ms", "gpu_ms", "vs_dense", "error")})
PY
