# Fused decoder layers (post-attention work in GEMM epilogues) on the device: the epilogue
# GEMMs' probe (correctness, timing; SWEEP=1: the SwiGLU plans), then Table V points with
# --fuse-layers in the best setting, every method alike (UNFUSED=1: each point's CIS row also
# without it, in the same run, to compare).
# Usage: PRHS_COMMIT=<sha> [PROBE=1] [SWEEP=1] [FUSE_LAYERS=1] [UNFUSED=1]
#        [POINTS="llama2-7b:8:16384:sdpa,CIS ..."] bash benchmarks/scripts/fused_layers_device.sh
set -e
export PYTHONPATH=packages/prhs-core/src:packages/prhs-kernels/src:packages/prhs-selectors/src:packages/prhs-eval/src
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ -n "$PROBE" ]; then
    python benchmarks/scripts/epilogue_gemm_probe.py ${SWEEP:+--sweep} --out "$OUT/probe" 2>&1 | grep -v "^\[transformers\]"
fi
best="--compile --compile-scope layers --fuse --gemm triton"
reuse="prhs[block_size=8;tau=-1.0;rescore=0]"
for point in $POINTS; do  # shape:batch:context:methods (CIS stands for the CIS-8 reuse row)
    IFS=: read -r shape batch context methods <<< "$point"
    methods=${methods//CIS/$reuse}
    python -m prhs_eval table5 --shapes "$shape" --batches "$batch" --contexts "$context" \
        --methods "$methods" $best ${FUSE_LAYERS:+--fuse-layers} \
        --out "$OUT/$shape-b$batch-t$context" 2>&1 | grep -v "^\[transformers\]"
    rm -f "$OUT/$shape-b$batch-t$context"/table5/{README.md,table.rst,*.png}
    if [ -n "$UNFUSED" ]; then
        python -m prhs_eval table5 --shapes "$shape" --batches "$batch" --contexts "$context" \
            --methods "$reuse" $best --out "$OUT/$shape-b$batch-t$context-unfused" 2>&1 \
            | grep -v "^\[transformers\]"
        rm -f "$OUT/$shape-b$batch-t$context-unfused"/table5/{README.md,table.rst,*.png}
    fi
done
# Only a few files come back from the device: every point's rows in one file as well.
cat "$OUT"/*/table5/rows.jsonl > "$OUT/all-rows.jsonl" 2>/dev/null || true
