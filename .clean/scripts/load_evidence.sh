#!/usr/bin/env bash
# The evidence of serving under load on one GPU: `bcg load` with the issue's workload (Poisson arrivals, lognormal
# lengths of median 180 in 16..4000, an 8192-token budget) on llama-dense and gptoss-moe, every backend side by side;
# a shared 1,000-token system prompt with the prefix cache on and off; the serving soak on the GPU; and
# benchmarks/load_targets.py's verdict over the runs. Usage: scripts/load_evidence.sh [OUTDIR] (default $OUT, else
# out/load-gpu); every step's log is bundled into load.tgz after each step.
#   RATES      offered loads, req/s (default: 100,300,900,1500,2500: past saturation, so throughput saturates)
#   DURATION   seconds of arrivals per rate (default 10)
#   T_LOAD     time limit of one step in seconds (default 540)
set -uo pipefail
source "$(dirname "$0")/steps.sh"
setup load.tgz out/load-gpu "$@"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee "$work/summary.log"
rates=${RATES:-100,300,900,1500,2500}
common="--duration ${DURATION:-10} --lengths lognormal:180 --chunked-prefill-size 8192 --no-progress"
load() {  # load NAME MODEL BACKENDS [FLAGS...]
  local name=$1 model=$2 backends=$3; shift 3
  step "load-$name" "${T_LOAD:-540}" python3 -m bcg load --model "$model" --backends "$backends" $common \
    --out "$work/$name" "$@"
}
load llama-dense llama-dense breakable+fused,tc_piecewise --rates "$rates"
load gptoss-moe gptoss-moe breakable+fused,tc_piecewise --rates "$rates"
load llama-dense-others llama-dense eager,full+fused --rates 100,300,900
# gptoss-moe's 4,096-token context cannot hold 1,000 + 4,000 tokens: the shared prefix runs on llama-dense only.
load prefix-on llama-dense breakable+fused --rates 100,300,900 --shared-prefix 1000
load prefix-off llama-dense breakable+fused --rates 100,300,900 --shared-prefix 1000 --no-prefix-cache
step soak 300 python3 benchmarks/serve_soak.py --device cuda --dtype bfloat16 --presets tiny-dense,tiny-moe
TAIL=40 step targets 60 python3 benchmarks/load_targets.py --runs "$work/llama-dense" "$work/gptoss-moe" \
  --prefix-on "$work/prefix-on" --prefix-off "$work/prefix-off"
