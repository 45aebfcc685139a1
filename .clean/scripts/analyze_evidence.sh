#!/usr/bin/env bash
# The evidence of `bcg analyze` on one GPU (issue 30): the time to predict as a user runs it (default flags, the
# default model), first measuring this machine's costs (--machine-cache refresh) and then again from the cache (the
# <= 5 s target); per model one `bcg analyze --validate` (predict every backend before capturing, then capture and
# measure them, side by side with the error); a Qwen3-0.6B-shaped checkpoint run by transformers; the host-as-a-variable
# run on llama-dense and on that checkpoint; and benchmarks/analyze_targets.py's tables and verdict over all of them,
# which also writes analyze_h200.json.gz, the replay fixture of tests/bench/test_analyze_evidence.py (copy it to
# tests/bench/fixtures/). Usage: scripts/analyze_evidence.sh [OUTDIR] (default $OUT, else out/analyze-gpu); every
# step's log is bundled into analyze.tgz after each step.
#   MODELS         presets validated (default: llama-dense gptoss-moe glm-dsa)
#   ANALYZE_ARGS   extra flags of every validated run (default: none; analyze times --runs 10 --warmup 3)
#   CHECKPOINT     scripts/make_checkpoint.py shape run through transformers (default: qwen3-0.6b; empty skips it)
#   BUDGET         --memory-budget of one more validated run of BUDGET_MODEL (default 1GiB, llama-dense; empty skips)
#   CORES          core counts of the --cpu-cores runs (default: 2,4,8,16; empty skips them)
#   TIMES          1 (default) runs the cold and warm prediction-time runs first; 0 skips them
#   T_ANALYZE      time limit of one run in seconds (default 600)
set -uo pipefail
source "$(dirname "$0")/steps.sh"
setup analyze.tgz out/analyze-gpu "$@"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee "$work/summary.log"
args=${ANALYZE_ARGS:-}
if [ "${TIMES:-1}" != 0 ]; then
  step analyze-cold "${T_ANALYZE:-600}" python3 -m bcg analyze --machine-cache refresh --no-progress --no-plots \
    --out "$work/analyze-cold"
  step analyze-warm "${T_ANALYZE:-600}" python3 -m bcg analyze --no-progress --no-plots --out "$work/analyze-warm"
fi
for model in ${MODELS:-llama-dense gptoss-moe glm-dsa}; do
  step "analyze-$model" "${T_ANALYZE:-600}" python3 -m bcg analyze --model "$model" --validate --no-progress \
    --out "$work/analyze-$model" $args
done
if [ -n "${BUDGET-1GiB}" ]; then  # the recommendation under an explicit graph-memory budget (issue 30)
  step analyze-budget "${T_ANALYZE:-600}" python3 -m bcg analyze --model "${BUDGET_MODEL:-llama-dense}" --validate \
    --memory-budget "${BUDGET-1GiB}" --no-progress --out "$work/analyze-budget" $args
fi
checkpoint=${CHECKPOINT-qwen3-0.6b}
if [ -n "$checkpoint" ]; then
  ckpt=$(mktemp -d)/$checkpoint  # outside $work: 1.2 GB must not go into the bundle
  step "make-$checkpoint" 120 python3 scripts/make_checkpoint.py "$checkpoint" "$ckpt"
  step "analyze-$checkpoint-hf" "${T_ANALYZE:-600}" python3 -m bcg analyze --model "$ckpt" --model-impl transformers \
    --validate --no-progress --out "$work/analyze-$checkpoint-hf" $args
fi
if [ -n "${CORES-2,4,8,16}" ]; then
  step analyze-cores "${T_ANALYZE:-600}" python3 -m bcg analyze --model llama-dense --validate \
    --backends breakable+fused,tc_piecewise --cpu-cores "${CORES-2,4,8,16}" --no-progress \
    --out "$work/analyze-cores" $args
  if [ -n "$checkpoint" ]; then
    step "analyze-cores-$checkpoint-hf" "${T_ANALYZE:-600}" python3 -m bcg analyze --model "$ckpt" \
      --model-impl transformers --validate --backends breakable,tc_piecewise --cpu-cores "${CORES-2,4,8,16}" \
      --no-progress --out "$work/analyze-cores-$checkpoint-hf" $args
  fi
fi
[ -n "$checkpoint" ] && rm -rf "$(dirname "$ckpt")"
TAIL=80 step targets 60 python3 benchmarks/analyze_targets.py "$work"/analyze-*/results.json \
  --fixture "$work/analyze_h200.json.gz"
