# Table V's key points in the best setting (decoder layers compiled whole, fused projections, the
# decode GEMM), one shape per call. Usage:
#   PRHS_COMMIT=<sha> bash benchmarks/scripts/table5_keypoints_device.sh llama2-7b|llama3-8b
set -e
M="prhs[block_size=8;tau=-1.0;rescore=0]"
S="--compile --compile-scope layers --fuse --gemm triton"
if [ "$1" = llama2-7b ]; then
    METHODS="sdpa,dense,quest,prhs,$M" SUB=llama2-b8-t16k bash benchmarks/scripts/table5_device.sh \
        llama2-7b $S --batches 8 --contexts 16384 | grep "ms/step"
    METHODS="sdpa,$M" SUB=llama2-t4k bash benchmarks/scripts/table5_device.sh \
        llama2-7b $S --batches 1,16 --contexts 4096 | grep "ms/step"
else
    # transformers' sdpa traced with a GQA layer over the static cache takes a slow path (80.9 ms
    # at B16·T16k): the dense kernel is the best dense here.
    METHODS="dense,quest,$M" SUB=llama3-b16 bash benchmarks/scripts/table5_device.sh \
        llama3-8b $S --batches 16 --contexts 16384,32768 | grep "ms/step"
fi
find "$OUT" \( -name "*.png" -o -name README.md -o -name table.rst \) -delete
