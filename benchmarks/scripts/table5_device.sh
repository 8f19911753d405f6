# Table V on the device: one shape per call (each fits the 10-minute limit), written to
# $OUT/${SUB:-SHAPE}/table5/; `prhs-eval table5 --from-rows A,B` joins them into docs/results/table5/.
# Usage: PRHS_COMMIT=<sha> [METHODS=...] [SUB=name] bash benchmarks/scripts/table5_device.sh SHAPE \
#            [extra table5 args, e.g. --compile --batches 8 --contexts 16384]
set -e
export PYTHONPATH=packages/prhs-core/src:packages/prhs-kernels/src:packages/prhs-selectors/src:packages/prhs-eval/src
shape=$1; shift
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -m prhs_eval table5 --shapes "$shape" --methods "${METHODS:-sdpa,dense,quest,prhs,prhs[tau=-1.0]}" \
    --out "$OUT/${SUB:-$shape}" "$@" 2>&1 | grep -v "^\[transformers\]"
if [ -n "$PROFILE" ]; then
    python benchmarks/scripts/table5_profile.py --shape llama2-7b --batch 1 --context 4096 --out "$OUT/profile" 2>&1 | grep -v "^\[transformers\]"
    python benchmarks/scripts/table5_profile.py --shape llama2-7b --batch 8 --context 16384 --methods "sdpa,prhs[tau=-1.0]" --out "$OUT/profile" 2>&1 | grep -v "^\[transformers\]"
fi
