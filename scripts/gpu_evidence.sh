#!/usr/bin/env bash
# One GPU session: the CUDA test tier, the break-cost and host-path benchmarks, `bcg bench` and `bcg analyze` for
# every GPU preset. Usage: scripts/gpu_evidence.sh [OUTDIR]   (default $OUT, else out/gpu); everything is bundled
# into gpu.tgz. STEPS picks steps (default "tests break_cost host_path models"), MODELS and ANALYZE_MODELS the presets.
# Each step has its own time limit so one slow step cannot starve the others; a failed step does not stop the rest.
set -uo pipefail
dest=${1:-${OUT:-out/gpu}}
work=$(mktemp -d)
mkdir -p "$dest"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s" | tee -a "$work/summary.log"
  tail -n "${TAIL:-25}" "$work/$name.log" | tee -a "$work/summary.log"
  # Bundle after every step, so a run cut short by its time limit still returns what it measured.
  tar czf "$dest/gpu.tgz" -C "$work" . && cp "$work/summary.log" "$dest/summary.log"
}
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no cuda')" | tee "$work/summary.log"
steps=" ${STEPS:-tests break_cost host_path models} "
case $steps in *" tests "*)
  step cuda_tests "${T_TESTS:-200}" python3 -m pytest -q -m cuda -p no:cacheprovider -rf tests ;; esac
case $steps in *" break_cost "*)
  step break_cost 60 python3 benchmarks/break_cost.py --out "$work/break_cost.json" ;; esac
case $steps in *" host_path "*)
  for tokens in ${HOST_PATH_TOKENS:-64 512}; do
    step "host_path-$tokens" 120 python3 benchmarks/host_path.py --model llama-dense --tokens "$tokens" \
      --out "$work/host_path-$tokens"
  done ;; esac
models=${MODELS:-llama-dense gptoss-moe glm-dsa}
case $steps in *" models "*) ;; *) models="" ;; esac
# Order: what matters most first (a run cut short keeps the earlier steps).
for model in $models; do
  step "bench-$model" "${T_BENCH:-150}" python3 -m bcg bench --model "$model" --no-progress --out "$work/bench-$model" \
    ${BENCH_ARGS:-}
  case " ${ANALYZE_MODELS:-llama-dense gptoss-moe glm-dsa} " in *" $model "*)
    step "analyze-$model" "${T_ANALYZE:-90}" python3 -m bcg analyze --model "$model" --no-progress \
      --out "$work/analyze-$model" ${ANALYZE_ARGS:-} ;;
  esac
done
