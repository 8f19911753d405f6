# The o projection's weight prefetched into L2 by the q/k/v GEMM, on the device: the probe of
# the pattern (l2_prefetch_probe.py; PROBE=1), then Table V points in the best setting with
# --fuse-layers, one row per variant in the same run: VARIANTS="base pf pf+ef ef" (pf:
# --prefetch-weights; ef: the sparse kernel loads K/V evict_first; MODE=lines|bulk and
# EVICT_LAST=0|1 set prhs_kernels.gemm.triton.PREFETCH).
# Usage: PRHS_COMMIT=<sha> [PROBE=1] [VARIANTS=...] [POINTS="llama2-7b:8:4096:CIS ..."] \
#        bash benchmarks/scripts/prefetch_device.sh
set -e
export PYTHONPATH=packages/prhs-core/src:packages/prhs-kernels/src:packages/prhs-selectors/src:packages/prhs-eval/src
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ -n "$PROBE" ]; then
    python benchmarks/scripts/l2_prefetch_probe.py --out "$OUT/probe" 2>&1 | tail -40
fi
best="--compile --compile-scope layers --fuse --gemm triton --fuse-layers"
reuse="prhs[block_size=8;tau=-1.0;rescore=0]"
for point in $POINTS; do  # shape:batch:context:methods (CIS stands for the CIS-8 reuse row)
    IFS=: read -r shape batch context methods <<< "$point"
    methods=${methods//CIS/$reuse}
    for variant in ${VARIANTS:-base pf}; do
        flags=""
        ef=False
        case "$variant" in *pf*) flags="--prefetch-weights" ;; esac
        case "$variant" in *ef*) ef=True ;; esac
        dir="$OUT/$shape-b$batch-t$context-$variant"
        python - table5 --shapes "$shape" --batches "$batch" --contexts "$context" \
            --methods "$methods" $best $flags --out "$dir" <<EOF 2>&1 | grep -v "^\[transformers\]"
import sys
import prhs_kernels.gemm.triton as g
import prhs_kernels.sparse_decode.triton as s
s.TUNING["kv_evict_first"] = $ef
g.PREFETCH["mode"] = "${MODE:-bulk}"
g.PREFETCH["evict_last"] = bool(${EVICT_LAST:-1})
from prhs_eval.cli import main
sys.exit(main(sys.argv[1:]))
EOF
        rm -f "$dir"/table5/{README.md,table.rst,*.png}
        sed "s/^{/{\"variant\": \"$variant\", /" "$dir/table5/rows.jsonl" >> "$OUT/all-rows.jsonl" || true
    done
done
