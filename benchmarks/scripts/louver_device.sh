#!/usr/bin/env bash
# Louver on one GPU: the index build (Triton) against its torch reference at a decode step's
# size and timed, the selector's Triton step against its torch step, CUDA-graph replay equals
# eager, then the step timings against dense attention, oracle and Quest (budget 1024, Hq 32,
# Hkv 8, D 128, bf16). Run from the repo root; results under $OUT.
set -uo pipefail
OUT=${OUT:-louver-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/packages/prhs-core/src:$PWD/packages/prhs-kernels/src:$PWD/packages/prhs-selectors/src
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python - "$OUT/check.jsonl" > "$OUT/check.log" 2>&1 <<'PY'
import os, sys
sys.path.insert(0, "benchmarks/scripts")
import kernels as K
with open(sys.argv[1], "a") as out:
    K.emit(out, {"part": "machine", **K.machine()})
    K.check_louver_index(out)
    K.check_selector_paths(out, "louver", {"budget": 1024})
PY
echo "check rc=$?"
python benchmarks/scripts/decode_step.py check --selectors louver --batches 1,16 --steps 16 --out "$OUT/graph.jsonl" > "$OUT/graph.log" 2>&1
echo "graph rc=$?"
python benchmarks/scripts/decode_step.py bench --selectors "oracle,quest,louver" --shapes "${SHAPES:-1x16,16x16,16x64}" --budget 1024 --out "$OUT/bench.jsonl" > "$OUT/bench.log" 2>&1
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
            print(r)
        elif "selector" in r and r.get("part") == "check":
            print(r["selector"], r["batch"], "graph==eager", r["graph_equals_eager"], r["max_abs_diff"], r["capture_error"], r["sync_error"])
        elif r.get("part") == "bench":
            print({k: (round(r[k], 4) if isinstance(r.get(k), float) else r.get(k)) for k in ("selector", "shape", "ms", "gpu_ms", "vs_dense", "error")})
PY
