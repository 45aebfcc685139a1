#!/usr/bin/env bash
# The evidence of `bcg analyze` on one GPU (issue 23): per model one `bcg analyze --validate` (predict every backend
# before capturing, then capture and measure them, side by side with the error), a Qwen3-0.6B-shaped checkpoint run
# by transformers, the host-as-a-variable run on llama-dense and on that checkpoint, and
# benchmarks/analyze_targets.py's tables and verdict over all of them. Usage: scripts/analyze_evidence.sh [OUTDIR] (default $OUT, else out/analyze-gpu); every step's log
# is bundled into analyze.tgz after each step.
#   MODELS         presets (default: llama-dense gptoss-moe glm-dsa)
#   ANALYZE_ARGS   extra flags of every analyze run (default: --runs 20 --warmup 5)
#   CORES          core counts of the --cpu-cores runs (default: 2,4,8,16; empty skips them)
#   T_ANALYZE      time limit of one run in seconds (default 600)
set -uo pipefail
source "$(dirname "$0")/steps.sh"
setup analyze.tgz out/analyze-gpu "$@"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee "$work/summary.log"
args=${ANALYZE_ARGS:---runs 20 --warmup 5}
for model in ${MODELS:-llama-dense gptoss-moe glm-dsa}; do
  step "analyze-$model" "${T_ANALYZE:-600}" python3 -m bcg analyze --model "$model" --validate --no-progress \
    --out "$work/analyze-$model" $args
done
ckpt=$(mktemp -d)/qwen3-0.6b  # outside $work: 1.2 GB must not go into the bundle
step make-qwen3 120 python3 scripts/make_checkpoint.py qwen3-0.6b "$ckpt"
step analyze-qwen3-0.6b-hf "${T_ANALYZE:-600}" python3 -m bcg analyze --model "$ckpt" --model-impl transformers \
  --validate --no-progress --out "$work/analyze-qwen3-0.6b-hf" $args
if [ -n "${CORES-2,4,8,16}" ]; then
  step analyze-cores "${T_ANALYZE:-600}" python3 -m bcg analyze --model llama-dense --validate \
    --backends breakable+fused,tc_piecewise --cpu-cores "${CORES-2,4,8,16}" --no-progress \
    --out "$work/analyze-cores" $args
  step analyze-cores-qwen3-0.6b-hf "${T_ANALYZE:-600}" python3 -m bcg analyze --model "$ckpt" \
    --model-impl transformers --validate --backends breakable,tc_piecewise --cpu-cores "${CORES-2,4,8,16}" \
    --no-progress --out "$work/analyze-cores-qwen3-0.6b-hf" $args
fi
rm -rf "$ckpt"
TAIL=40 step targets 60 python3 benchmarks/analyze_targets.py "$work"/analyze-*/results.json
