# CIS's retrieval in CUDA-graph conditional nodes, on the device: GPU tests, graph == eager over
# steps that do and do not retrieve, the node's cost, then Table V points with and without.
# Needs a torch whose CUDAGraph has begin_capture_to_if_node (the device image's 2.11 has not).
# Usage: PRHS_COMMIT=<sha> bash benchmarks/scripts/conditional_device.sh
set -e
export PRHS_GRAPH_CONDITIONALS=1
export PYTHONPATH=packages/prhs-core/src:packages/prhs-kernels/src:packages/prhs-selectors/src:packages/prhs-eval/src
python -m pytest -q -p no:cacheprovider packages/prhs-kernels/tests/test_graphs.py packages/prhs-selectors/tests/test_cis.py 2>&1 | tail -3
python benchmarks/scripts/cond_node_probe.py || true  # needs a torch with the API
for opts in "--cis tau=-1.0 --cis block_size=8 --cis rescore=0" ""; do
    python benchmarks/scripts/decode_step.py check --selectors cis --batches 1,16 $opts \
        --out "$OUT/check.jsonl" 2>&1 | grep -v "^\[transformers\]" | grep '"selector"' || true
done
M="prhs[block_size=8;tau=-1.0;rescore=0]"
run() {  # $1: sub-folder, then table5 args
    sub=$1; shift
    METHODS="${METHODS:-sdpa,$M}" SUB=$sub bash benchmarks/scripts/table5_device.sh llama2-7b \
        --compile --compile-scope layers --fuse --gemm triton "$@" 2>&1 | grep "ms/step"
}
run llama2-b8-cond --batches 8 --contexts 16384
PRHS_GRAPH_CONDITIONALS=0 METHODS="$M" run llama2-b8-nocond --batches 8 --contexts 16384
run llama2-b1-b16-cond --batches 1,16 --contexts 4096
find "$OUT" \( -name "*.png" -o -name README.md -o -name table.rst \) -delete
