# Table V on the device, one shape per call: every (B, T) that fits, sdpa, dense, Quest and the
# CIS-8 reuse row in the best setting, written to $OUT/<shape>/table5 and appended to
# $OUT/all-rows.jsonl. Without Quest a shape took about 10 minutes; with it, split a shape over
# two calls (CONTEXTS=4096,16384 then CONTEXTS=32768). Usage: SHAPE=llama2-7b bash ...
set -e
export PYTHONPATH=$PWD/packages/prhs-core/src:$PWD/packages/prhs-kernels/src:$PWD/packages/prhs-selectors/src:$PWD/packages/prhs-eval/src
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -m prhs_eval table5 --shapes "$SHAPE" --batches "${BATCHES:-1,8,16}" \
    --contexts "${CONTEXTS:-4096,16384,32768}" \
    --methods "${METHODS:-sdpa,dense,quest[budget=1024],prhs[block_size=8;tau=-1.0;rescore=0]}" \
    --compile --compile-scope layers --fuse --gemm triton --fuse-layers --out "$OUT/$SHAPE" \
    2>&1 | grep -v "^\[transformers\]\|Warning\|warn\|^$\|This call\|if _forced\|^ "
rm -f "$OUT/$SHAPE"/table5/{table.rst,*.png}
cat "$OUT/$SHAPE/table5/rows.jsonl" >> "$OUT/all-rows.jsonl"
