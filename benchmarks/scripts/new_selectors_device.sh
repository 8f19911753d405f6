# The issue-12 selectors on one GPU: CUDA-graph replay equals eager, then step timings against
# dense attention and oracle (budget 1024, Hq 32, Hkv 8, D 128, bf16). Run from the repo root.
set -e
export PYTHONPATH=$PWD/packages/prhs-core/src:$PWD/packages/prhs-kernels/src:$PWD/packages/prhs-selectors/src
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
SEL=${SEL:-double_sparsity,hshare,compkv,rabitq,louver}
python benchmarks/scripts/decode_step.py check --selectors $SEL --batches 1,16 --steps 16 --out $OUT/check.jsonl > /dev/null
python benchmarks/scripts/decode_step.py bench --selectors oracle,quest,$SEL --shapes 1x16,16x16,16x64 --budget 1024 --out $OUT/bench.jsonl > /dev/null
grep selector $OUT/check.jsonl | python -c "import sys,json; [print({k:r.get(k) for k in ('selector','batch','graph_equals_eager','max_abs_diff','capture_error','sync_error')}) for r in map(json.loads,sys.stdin)]"
grep '"bench"' $OUT/bench.jsonl | python -c "import sys,json; [print({k:(round(r[k],4) if isinstance(r.get(k),float) else r.get(k)) for k in ('selector','shape','ms','gpu_ms','vs_dense','error')}) for r in map(json.loads,sys.stdin)]"
