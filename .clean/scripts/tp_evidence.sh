#!/usr/bin/env bash
# Tensor parallel on the GPUs of one host: the TP CUDA tests, `bcg bench` at TP=1 and TP=N, the same-tokens check
# of TP=N against TP=1, and the speedup/capture comparison (benchmarks/tp_compare.py) per model.
# Usage: scripts/tp_evidence.sh [OUTDIR]   (default $OUT, else out/tp); everything is bundled into tp.tgz.
# GPUS: ranks to use (default: every visible GPU; needs 2+). TPS: the TP sizes besides 1 (default "$GPUS").
# MODELS (default "llama-dense-2k gptoss-moe"), LENGTHS (default 64,128,256,512,1024,2048), BENCH_ARGS (extra flags
# of every bench run, default --no-memory), STEPS (default "tests bench tokens").
# Each step has its own time limit; a failed step does not stop the rest.
set -uo pipefail
source "$(dirname "$0")/steps.sh"
setup tp.tgz out/tp "$@"
gpus=${GPUS:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), \
[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])" | tee "$work/summary.log"
nvidia-smi topo -m >>"$work/summary.log" 2>&1 || true
if [ "$gpus" -lt 2 ]; then
  echo "tp_evidence: $gpus GPU(s) visible; tensor parallel needs 2 or more" | tee -a "$work/summary.log"
  cp "$work/summary.log" "$dest/summary.log"
  exit 2
fi
tps=${TPS:-$gpus}
lengths=${LENGTHS:-64,128,256,512,1024,2048}
bench_args=${BENCH_ARGS:---no-memory}
steps=" ${STEPS:-tests bench tokens} "
launch() { torchrun --standalone --nproc-per-node "$1" "${@:2}"; }
case $steps in *" tests "*)
  step cuda_tp_tests "${T_TESTS:-400}" python3 -m pytest -q -m cuda -p no:cacheprovider -rf \
    tests/runtime/test_tensor_parallel_cuda.py ;; esac
for model in ${MODELS:-llama-dense-2k gptoss-moe}; do
  case $steps in *" bench "*)
    step "bench-$model-tp1" "${T_BENCH:-300}" python3 -m bcg bench --model "$model" --lengths "$lengths" \
      --no-progress --out "$work/bench-$model-tp1" $bench_args
    for n in $tps; do
      step "bench-$model-tp$n" "${T_BENCH:-300}" launch "$n" -m bcg bench --model "$model" --tp "$n" \
        --lengths "$lengths" --no-progress --out "$work/bench-$model-tp$n" $bench_args
      step "compare-$model-tp$n" 30 python3 benchmarks/tp_compare.py "$work/bench-$model-tp1/results.json" \
        "$work/bench-$model-tp$n/results.json" --out "$work/compare-$model-tp$n.md"
    done ;; esac
  case $steps in *" tokens "*)
    for n in $tps; do
      step "tokens-$model-tp$n" "${T_TOKENS:-300}" launch "$n" benchmarks/tp_tokens.py --model "$model" \
        --lengths 64,512,2048 --out "$work/tokens-$model-tp$n"
    done ;; esac
done
