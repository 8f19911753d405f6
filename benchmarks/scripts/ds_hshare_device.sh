set -e
export PYTHONPATH=$PWD/packages/prhs-core/src:$PWD/packages/prhs-kernels/src:$PWD/packages/prhs-selectors/src
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python benchmarks/scripts/decode_step.py check --selectors double_sparsity,hshare,oracle --batches 1,16 --steps 16 --out $OUT/check.jsonl > /dev/null
python benchmarks/scripts/decode_step.py bench --selectors oracle,quest,double_sparsity,hshare --shapes 1x16,16x16,16x64 --budget 1024 --out $OUT/bench.jsonl > /dev/null
cat $OUT/check.jsonl | grep selector | python -c "import sys,json; [print({k:r[k] for k in ('selector','batch','graph_equals_eager','max_abs_diff','capture_error')}) for r in map(json.loads,sys.stdin)]"
cat $OUT/bench.jsonl | grep '"bench"' | python -c "import sys,json; [print({k:r.get(k) for k in ('selector','shape','ms','gpu_ms','vs_dense','error')}) for r in map(json.loads,sys.stdin)]"
