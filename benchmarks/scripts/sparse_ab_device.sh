# The sparse decode kernel against an earlier version of it, in one device run: the kernel probe
# at the CIS-8 shapes, then Table V's CIS-8 reuse row at two points, old and new alternating
# twice (the comparison is within the run: the spread between runs is as large as the change).
# Usage (from the repository root; OLD is the earlier sparse_decode/triton.py, e.g.
#   git show <sha>:packages/prhs-kernels/src/prhs_kernels/sparse_decode/triton.py > old_split.py):
#   PRHS_COMMIT=<sha> OLD=old_split.py bash benchmarks/scripts/sparse_ab_device.sh
set -e
export PYTHONPATH=packages/prhs-core/src:packages/prhs-kernels/src:packages/prhs-selectors/src:packages/prhs-eval/src
nvidia-smi --query-gpu=name --format=csv,noheader
F=packages/prhs-kernels/src/prhs_kernels/sparse_decode/triton.py
NEW=$(mktemp)
cp "$F" "$NEW"
trap 'cp "$NEW" "$F"' EXIT
use() { if [ "$1" = old ]; then cp "$OLD" "$F"; else cp "$NEW" "$F"; fi; }
SH="--shipped-only --shapes 8:32:8:contig,1:32:8:contig,16:8:8:contig,16:8:1:paged1"
best="--compile --compile-scope layers --fuse --gemm triton --fuse-layers"
reuse="prhs[block_size=8;tau=-1.0;rescore=0]"
for v in old new; do
    use $v
    echo "== $v"
    python benchmarks/scripts/sparse_probe.py $SH --out "$OUT/probe-$v.jsonl" 2>&1 | grep -A5 "graph replay"
done
for pt in "llama3-8b 16 16384" "llama2-7b 8 4096"; do
    set -- $pt
    for v in old new old new; do
        use $v
        python -m prhs_eval table5 --shapes "$1" --batches "$2" --contexts "$3" --methods "$reuse" \
            $best --out "$OUT/t5" 2>&1 | grep "ms/step" | sed "s/^/$v /"
        sed "s/\"method\": \"/\"method\": \"$v:/" "$OUT/t5/table5/rows.jsonl" >> "$OUT/t5-rows.jsonl"
        rm -rf "$OUT/t5"
    done
done
