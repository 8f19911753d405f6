# Table V points timed over the window (mean of 128 consecutive steps), each step's time
# printed in compact form: which steps of the window are the expensive ones (a selector's
# retrievals), against the median step. Usage on the device:
#   POINTS="llama2-7b:8:16384:sdpa,CIS,RET ..." bash benchmarks/scripts/step_window_device.sh
# (CIS: the CIS-8 reuse row; RET: the same selector retrieving at every step.)
set -e
export PYTHONPATH=$PWD/packages/prhs-core/src:$PWD/packages/prhs-kernels/src:$PWD/packages/prhs-selectors/src:$PWD/packages/prhs-eval/src
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
best="--compile --compile-scope layers --fuse --gemm triton --fuse-layers"
for point in $POINTS; do
    IFS=: read -r shape batch context methods <<< "$point"
    methods=${methods//CIS/prhs[block_size=8;tau=-1.0;rescore=0]}
    methods=${methods//RET/prhs[block_size=8;rescore=0]}
    dir="$OUT/$shape-b$batch-t$context"
    python - table5 --shapes "$shape" --batches "$batch" --contexts "$context" \
        --methods "$methods" $best --out "$dir" <<'PY' 2>&1 | grep -v "^\[transformers\]\|Warning\|warn\|^$\|This call\|if _forced"
import sys
import prhs_kernels.timing as timing
real = timing.window_ms
def window_ms(fn, calls, warmup=0):
    w = real(fn, calls, warmup=warmup)
    big = [(i, round(t, 3)) for i, t in enumerate(w.per_call_ms) if t > 1.2 * w.median_ms]
    print(f"window: {calls} steps, mean {w.mean_ms:.3f} ms, median {w.median_ms:.3f}, "
          f"min {min(w.per_call_ms):.3f}, steps over 1.2x median: {big}", flush=True)
    return w
timing.window_ms = window_ms
from prhs_eval.cli import main
sys.exit(main(sys.argv[1:]))
PY
    rm -f "$dir"/table5/{table.rst,*.png}
    cat "$dir/table5/rows.jsonl" >> "$OUT/all-rows.jsonl" || true
done
