# Programmatic dependent launch (PRHS_PDL) on the device: the decode GEMMs alone, then Table V's
# Llama-2-7B B8·T16k step with and without. Usage: PRHS_COMMIT=<sha> bash benchmarks/scripts/pdl_device.sh
set -e
export PYTHONPATH=packages/prhs-core/src:packages/prhs-kernels/src:packages/prhs-selectors/src:packages/prhs-eval/src
python -m pytest -q -p no:cacheprovider packages/prhs-kernels/tests/test_gemm.py 2>&1 | tail -1
for v in 0 1; do
    PRHS_PDL=$v python benchmarks/scripts/skinny_gemm_probe.py --batches 8 --out "$OUT/gemm-pdl$v" 2>&1 | tail -12
done
M="prhs[block_size=8;tau=-1.0;rescore=0]"
for v in 1 0; do
    methods="$M"; [ $v = 1 ] && methods="sdpa,$M"
    PRHS_PDL=$v METHODS="$methods" SUB=llama2-b8-pdl$v bash benchmarks/scripts/table5_device.sh llama2-7b \
        --compile --compile-scope layers --fuse --gemm triton --batches 8 --contexts 16384 2>&1 | grep "ms/step"
done
find "$OUT" \( -name "*.png" -o -name README.md -o -name table.rst \) -delete
