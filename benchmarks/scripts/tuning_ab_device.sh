# Kernel tuning knobs A/B'd on Table V points, on the device: each point's CIS-8 reuse row (or
# the methods named) in the best setting with --fuse-layers, once per variant, all in one run.
# A variant is a '+'-joined list of knobs (anything else: the shipped settings):
#   ef    the sparse kernel loads K/V evict_first (TUNING["kv_evict_first"])
#   mlN   the sparse kernel's merge in the last slice up to N slices (TUNING["merge_last"])
#   wN    the sparse kernel's programs per multiprocessor its slice count aims at (TUNING["waves"])
#   nsN   the sparse kernel's software-pipelining depth (TUNING["num_stages"])
#   bnN   the sparse kernel's positions per tile (TUNING["block_n"])
#   nwN   the sparse kernel's warps per program (TUNING["num_warps"])
#   pdl   the decode path's kernels launch with programmatic dependent launch (prhs_kernels.pdl.PDL)
#   pdl_F1_F2 PDL, only the families F1, F2, ... launched early (prhs_kernels.pdl.KERNELS names:
#         gemm cis score sparse merge rows), e.g. pdl_cis_score_merge_rows
#   spN   the retrieval logits pass's persistent programs per multiprocessor
#         (prhs_kernels.score.triton.TUNING["programs_per_sm"])
#   bpN   the block-score pass's (prhs_kernels.cis.triton.TUNING["block_scores_programs_per_sm"])
#   qsB_W Quest's selection: radix bits B and at least W warps a program
#         (prhs_kernels.quest.triton.TUNING["radix_bits"] / ["select_warps"]), e.g. qs2_4
#   sk    the decode GEMM splits K where it has few stripes (prhs_kernels.gemm.triton.TUNING["split_k"])
#   rbtN  the row-bounds launch reads N columns a tile (prhs_kernels.kv.triton.BLOCK)
#   rbref the integration's row bounds by the torch reference (reductions + a cast), not one launch
#   norope the fused layers without the rotary epilogue (prhs_eval.throughput.ROPE_EPILOGUE off:
#         the rotation, the cache write and the length's add as launches of their own)
#   rlN_K_W_S the rotary q|k|v GEMM's launch (prhs_kernels.gemm.triton.TUNING_ROPE["launch"])
#   atC   the packages as of commit C, from ab/C/ (untracked: extract it first with
#         mkdir -p ab/C && git archive C packages/*/src | tar -x -C ab/C)
# Usage: PRHS_COMMIT=<sha> [VARIANTS="base ef"] [POINTS="llama2-7b:8:4096:CIS ..."] \
#        bash benchmarks/scripts/tuning_ab_device.sh
set -e
src_path() {  # the packages' src folders under $1
    echo "$1/packages/prhs-core/src:$1/packages/prhs-kernels/src:$1/packages/prhs-selectors/src:$1/packages/prhs-eval/src"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
best="--compile --compile-scope layers --fuse --gemm triton --fuse-layers"
reuse="prhs[block_size=8;tau=-1.0;rescore=0]"
for point in $POINTS; do  # shape:batch:context:methods (CIS stands for the CIS-8 reuse row)
    IFS=: read -r shape batch context methods <<< "$point"
    methods=${methods//CIS/$reuse}
    for variant in ${VARIANTS:-base ef}; do
        knobs=""
        tree=.
        for knob in ${variant//+/ }; do
            case "$knob" in
                ef) knobs="$knobs
s.TUNING['kv_evict_first'] = True" ;;
                ml*) knobs="$knobs
s.TUNING['merge_last'] = ${knob#ml}" ;;
                w*) knobs="$knobs
s.TUNING['waves'] = ${knob#w}" ;;
                ns*) knobs="$knobs
s.TUNING['num_stages'] = ${knob#ns}" ;;
                bn*) knobs="$knobs
s.TUNING['block_n'] = ${knob#bn}" ;;
                nw*) knobs="$knobs
s.TUNING['num_warps'] = ${knob#nw}" ;;
                pdl) knobs="$knobs
import prhs_kernels.pdl as P; P.PDL['enabled'] = True" ;;
                pdl_*) knobs="$knobs
import prhs_kernels.pdl as P; P.PDL.update(enabled=True, kernels=frozenset('${knob#pdl_}'.split('_')))" ;;
                sp*) knobs="$knobs
import prhs_kernels.score.triton as st; st.TUNING['programs_per_sm'] = ${knob#sp}" ;;
                bp*) knobs="$knobs
import prhs_kernels.cis.triton as ct; ct.TUNING['block_scores_programs_per_sm'] = ${knob#bp}" ;;
                qs*) bw=${knob#qs}; knobs="$knobs
import prhs_kernels.quest.triton as qt; qt.TUNING.update(radix_bits=${bw%_*}, select_warps=${bw#*_})" ;;
                sk) knobs="$knobs
import prhs_kernels.gemm.triton as gt; gt.TUNING['split_k'] = True" ;;
                norope) knobs="$knobs
import prhs_eval.throughput as T; T.ROPE_EPILOGUE = False" ;;
                rl*) knobs="$knobs
import prhs_kernels.gemm.triton as gt; gt.TUNING_ROPE['launch'] = tuple(int(v) for v in '${knob#rl}'.split('_'))" ;;
                at*) tree="ab/${knob#at}" ;;
                rbt*) knobs="$knobs
import prhs_kernels.kv.triton as kt; kt.BLOCK = ${knob#rbt}" ;;
                rbref) knobs="$knobs
import prhs_eval.integration as I; from prhs_kernels.kv import row_bounds_reference as R
I.row_bounds = lambda v, d: R(v)" ;;
            esac
        done
        dir="$OUT/$shape-b$batch-t$context-${variant//+/_}"
        PYTHONPATH=$(src_path "$tree") python - table5 --shapes "$shape" --batches "$batch" --contexts "$context" \
            --methods "$methods" $best --out "$dir" <<EOF 2>&1 | grep -v "^\[transformers\]\|Warning\|warn\|^$\|This call\|if _forced"
import sys
import prhs_kernels.sparse_decode.triton as s
$knobs
from prhs_eval.cli import main
sys.exit(main(sys.argv[1:]))
EOF
        rm -f "$dir"/table5/{README.md,table.rst,*.png}
        sed "s/^{/{\"variant\": \"$variant\", /" "$dir/table5/rows.jsonl" >> "$OUT/all-rows.jsonl" || true
    done
done
