export PYTHONPATH=packages/prhs-core/src:packages/prhs-kernels/src:packages/prhs-selectors/src:packages/prhs-eval/src
python -c "import matplotlib, transformers, triton, torch; print(matplotlib.__version__, transformers.__version__, triton.__version__, torch.__version__)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -m prhs_eval table5 --shapes llama3-8b --layers 4 --batches 1,4 --contexts 4096 --methods "sdpa,dense,quest,prhs,prhs[tau=0.0]" --out $OUT/smoke 2>&1 | grep -v "^\[transformers\]" | tail -40
ls $OUT/smoke/table5
