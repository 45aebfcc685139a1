#!/usr/bin/env bash
# One GPU session's evidence: the CUDA test tier, `bcg bench` (every variant side by side) and `bcg analyze` per GPU
# preset, a Qwen3-0.6B-shaped checkpoint loaded by path, the Hugging Face path (scripts/hf_evidence.py), the fused
# kernels' own cases, and the same bench on an earlier commit's code for a side-by-side check.
# Usage: scripts/gpu_evidence.sh [OUTDIR] (default $OUT, else out/gpu); every step's log is bundled into gpu.tgz
# after each step, so a run cut short still returns what it measured.
#   STEPS    which steps, in order (default: tests models checkpoint hf baseline kernel_tests)
#   MODELS   presets for the models step (default: llama-dense llama-dense-2k gptoss-moe glm-dsa)
#   ANALYZE_MODELS  presets that also get `bcg analyze` (default: llama-dense)
#   LOAD_MODELS / LOAD_RATES / LOAD_BACKENDS  the load step's presets and flags; prefix: the shared-prefix pair
#   Other steps: prefix, device, device2 (DEVICE2_ARGS, DEVICE2_ENV: e.g. BCG_QKV_FUSION=off), device_baseline,
#            variants (VARIANTS: space-separated NAME=ENV pairs, ENV's settings joined by commas, e.g.
#            "base= norm=BCG_NORM_FUSION=on pdl=BCG_PDL=1": the device step once per variant, each its own process,
#            VARIANT_ARGS their flags and VARIANT_ARGS_NAME one variant's own, VARIANT_ROUNDS times in turn),
#            host_path, prefill_host, hf_speed, load, soak, attention, reads (READS_ARGS), nodes (NODES_MODELS),
#            qkv (QKV_ROWS, QKV_ARGS), partials (PARTIALS_ARGS),
#            retest, capacity,
#            validate (VALIDATE_MODELS); a before/after baseline needs the earlier
#            commit's bcg/ (and benchmarks/device_bound.py with the host_path.py it imports) exported first:
#            mkdir .baseline && git archive COMMIT bcg benchmarks/device_bound.py benchmarks/host_path.py | tar -x -C .baseline
#   DEVICE_MODELS / DEVICE_ARGS / BASELINE_ARGS  models and flags of the device steps (benchmarks/device_bound.py: wall against
#            device time per length, whether a prefill ever synchronises, one timeline); device_baseline runs the
#            same on the code in .baseline/ (an export of an earlier commit's bcg/) for a before/after
#   BENCH_ARGS / ANALYZE_ARGS / TEST_ARGS / HF_ARGS / ATTENTION_ARGS (--sweep: block configurations)  extra flags;
#            TEST_SHARDS / KERNEL_SHARDS  pytest processes at once for the tests / kernel_tests steps (1 / 4);
#            KERNEL_TESTS  the kernel_tests step's files (default tests/ops/kernels);
#            T_* the per-step time limits in seconds; CLOCKS=0: no clocks.csv (the GPU's clock and power every
#            250 ms, to read a step's timings against).
set -uo pipefail
source "$(dirname "$0")/steps.sh"
setup gpu.tgz out/gpu "$@"
[ "${CLOCKS:-1}" = 0 ] || sample_clocks
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$work/summary.log"
git_rev=$(cat .commit 2>/dev/null || echo unknown); echo "commit $git_rev" | tee -a "$work/summary.log"
steps=" ${STEPS:-tests models checkpoint hf baseline kernel_tests} "
bench_args=${BENCH_ARGS:---runs 10 --warmup 3 --batch-requests 1 --no-memory}
bench() {  # bench NAME MODEL [FLAGS...]
  local name=$1 model=$2; shift 2
  step "bench-$name" "${T_BENCH:-240}" python3 -m bcg bench --model "$model" --no-progress --out "$work/bench-$name" \
    $bench_args "$@"
}
case $steps in *" tests "*)  # the fused kernels' own 583 cases are the kernel_tests step
  # TEST_SHARDS>1 runs that many pytest processes at once (scripts/pytest_shards.py; logs in cuda_tests/): engines
  # that size their KV pool by the free memory then see each other's, so it is asked for, not the default
  step cuda_tests "${T_TESTS:-300}" python3 scripts/pytest_shards.py --shards "${TEST_SHARDS:-1}" \
    --logs "$work/cuda_tests" -- -q -m cuda -p no:cacheprovider -rf --durations=15 --ignore=tests/ops/kernels \
    ${TEST_ARGS:-} tests ;; esac
case $steps in *" models "*)
  for model in ${MODELS:-llama-dense llama-dense-2k gptoss-moe glm-dsa}; do
    bench "$model" "$model"
    case " ${ANALYZE_MODELS:-llama-dense} " in *" $model "*)
      step "analyze-$model" "${T_ANALYZE:-90}" python3 -m bcg analyze --model "$model" --no-progress \
        --out "$work/analyze-$model" ${ANALYZE_ARGS:---runs 10 --warmup 3} ;;
    esac
  done ;; esac
case $steps in *" checkpoint "*)
  ckpt=$(mktemp -d)/qwen3-0.6b  # outside $work: 1.2 GB must not go into the bundle
  step make-qwen3 120 python3 scripts/make_checkpoint.py qwen3-0.6b "$ckpt"
  bench qwen3-0.6b "$ckpt" --backends eager,breakable,breakable+fused,breakable+inductor,tc_piecewise
  rm -rf "$ckpt" ;; esac
case $steps in *" hf "*)
  step hf "${T_HF:-220}" python3 scripts/hf_evidence.py --out "$work/hf.json" ${HF_ARGS:-} ;; esac
case $steps in *" baseline "*)
  # The same bench on the code before the layering change (an export of that commit's bcg/ in .baseline/) and on
  # this code, one after the other on the same machine.
  if [ -d .baseline/bcg ]; then
    for side in before after; do
      root=$PWD; [ $side = before ] && root=$PWD/.baseline
      step "baseline-$side" 120 env PYTHONPATH="$root" python3 -m bcg bench --model llama-dense \
        --backends eager,breakable --lengths 64,512,2048 --runs 10 --warmup 3 --batch-requests 1 --no-memory \
        --no-profile --no-plots --no-progress --out "$work/baseline-$side"
    done
  fi ;; esac
device_models=${DEVICE_MODELS:-llama-dense,gptoss-moe,glm-dsa,llama-3.2-1b,qwen3-0.6b}
case $steps in *" device "*)
  step device "${T_DEVICE:-300}" python3 benchmarks/device_bound.py --models "$device_models" --timeline \
    --backends "${DEVICE_BACKENDS:-breakable+full}" \
    --out "$work/device" ${DEVICE_ARGS:-} ;; esac
case $steps in *" device_baseline "*)
  if [ -d .baseline/bcg ]; then
    script=benchmarks/device_bound.py  # the earlier commit's own script where it was exported too (it puts its
    [ -f .baseline/$script ] && script=.baseline/$script  # checkout first on the path, before this one)
    step device_baseline "${T_DEVICE:-240}" env PYTHONPATH="$PWD/.baseline" python3 $script \
      --models "$device_models" --out "$work/device-baseline" ${BASELINE_ARGS:-${DEVICE_ARGS:-}}
  fi ;; esac
case $steps in *" hf_speed "*)  # transformers models against native and their own forward (benchmarks/hf_speed.py)
  step hf_speed "${T_HF_SPEED:-270}" python3 benchmarks/hf_speed.py --out "$work/hf_speed.json" ${HF_SPEED_ARGS:-} ;; esac
case $steps in *" host_path "*)
  step host_path 120 python3 benchmarks/host_path.py --model llama-dense --tokens 64 --out "$work/host_path" ;; esac
case $steps in *" prefill_host "*)  # this host's CPU alone: the engine's Python, and the launch warm and cold
  step prefill_host "${T_PREFILL_HOST:-90}" python3 benchmarks/prefill_host.py --runs 300 --device cuda ;; esac
case $steps in *" kernel_tests "*)
  # KERNEL_SHARDS pytest processes at once (default 4: the cases compile Triton kernels on the CPU, small tensors)
  step kernel_tests "${T_KERNELS:-150}" python3 scripts/pytest_shards.py --shards "${KERNEL_SHARDS:-4}" \
    --logs "$work/kernel_tests" -- -q -m cuda -p no:cacheprovider -rf --durations=10 \
    ${KERNEL_TESTS:-tests/ops/kernels} ;; esac
case $steps in *" load "*)  # serving under an open-loop load: every request answered, TTFT per backend and rate
  for model in ${LOAD_MODELS:-llama-dense}; do
    step "load-$model" "${T_LOAD:-300}" python3 -m bcg load --model "$model" \
      --backends "${LOAD_BACKENDS:-breakable+fused,tc_piecewise}" --rates "${LOAD_RATES:-900,1800}" --duration 5 \
      --lengths lognormal:180 --chunked-prefill-size 8192 --no-progress --out "$work/load-$model" ${LOAD_ARGS:-}
  done ;; esac
case $steps in *" prefix "*)  # a 1024-token shared system prompt with the prefix cache on and off, same requests
  for cache in prefix-cache no-prefix-cache; do
    step "$cache" "${T_LOAD:-300}" python3 -m bcg load --model llama-dense --backends breakable+fused \
      --rates "${PREFIX_RATES:-300}" --duration 5 --lengths lognormal:180 --shared-prefix 1024 --"$cache" \
      --chunked-prefill-size 8192 --no-progress --out "$work/$cache"
  done
  step load_targets 60 python3 benchmarks/load_targets.py --runs "$work"/load-*/ --prefix-on "$work/prefix-cache" \
    --prefix-off "$work/no-prefix-cache" ;; esac
case $steps in *" soak "*)  # the serving soak on the GPU, every attention backend the GPU runs
  step soak "${T_SOAK:-240}" python3 benchmarks/serve_soak.py --device cuda --dtype bfloat16 \
    --presets tiny-dense,tiny-moe ${SOAK_ARGS:-} ;; esac
case $steps in *" attention "*)  # the Triton varlen kernel against FlashAttention (with and without the island's copy)
  step attention "${T_ATTENTION:-150}" python3 benchmarks/attention_kernels.py --tokens 64,256,2048 \
    --out "$work/attention_kernels.json" ${ATTENTION_ARGS:-} ;; esac
case $steps in *" nodes "*)  # the engine's graphs by node type, and each whole-step graph's launch on the host
  step nodes "${T_NODES:-150}" python3 benchmarks/graph_nodes.py --models "${NODES_MODELS:-$device_models}" \
    --out "$work/graph_nodes.json" --dots "$work/graph_nodes" ;; esac
case $steps in *" reads "*)  # the varlen kernel under each way it reads keys (islands' vs whole-step graphs')
  step reads "${T_READS:-120}" python3 benchmarks/attention_reads.py --out "$work/attention_reads.json" \
    ${READS_ARGS:-} ;; esac
case $steps in *" retest "*)  # chosen CUDA tests again (RETEST: pytest node ids), e.g. those a fix was made for
  step retest "${T_RETEST:-180}" python3 -m pytest -q -m cuda -p no:cacheprovider -rf ${RETEST:-tests} ;; esac
case $steps in *" device2 "*)  # the device step again with other flags (DEVICE2_ARGS), e.g. another attention backend
  step device2 "${T_DEVICE:-300}" env ${DEVICE2_ENV:-} python3 benchmarks/device_bound.py --models "$device_models" \
    --out "$work/device2" ${DEVICE2_ARGS:-} ;; esac
case $steps in *" variants "*)  # the device step under each debug switch, in turn, each in a process of its own
  for round in $(seq "${VARIANT_ROUNDS:-1}"); do
    for variant in ${VARIANTS:-base=}; do
      name=${variant%%=*} settings=${variant#*=} own_args="VARIANT_ARGS_${variant%%=*}"
      step "variant-$name-$round" "${T_VARIANT:-150}" env ${settings//,/ } python3 benchmarks/device_bound.py \
        --models "$device_models" --out "$work/variant-$name-$round" ${VARIANT_ARGS:-} ${!own_args:-}
    done
  done ;; esac
case $steps in *" partials "*)  # the down projection as split-K partials for the next kernel (benchmarks/down_partials.py)
  step partials "${T_PARTIALS:-90}" python3 benchmarks/down_partials.py --out "$work/down_partials.json" \
    ${PARTIALS_ARGS:-} ;; esac
case $steps in *" qkv "*)  # the q/k/v projection: cuBLAS + the RoPE kernel against the one kernel (QKV_ARGS: --sweep)
  step qkv "${T_QKV:-150}" python3 benchmarks/qkv_kernels.py --rows "${QKV_ROWS:-16,64,128}" \
    --out "$work/qkv_kernels.json" ${QKV_ARGS:-} ;; esac
case $steps in *" validate "*)  # `bcg analyze --validate`: every backend predicted, then built and measured
  for model in ${VALIDATE_MODELS:-llama-dense}; do
    step "validate-$model" "${T_VALIDATE:-240}" python3 -m bcg analyze --model "$model" --validate --no-progress \
      --out "$work/validate-$model" ${VALIDATE_ARGS:---runs 10 --warmup 3}
  done ;; esac
case $steps in *" capacity "*)  # submit against a loop of prefill() calls on the same requests, past saturation
  step capacity "${T_CAPACITY:-150}" python3 benchmarks/serve_capacity.py --out "$work/capacity.json" \
    ${CAPACITY_ARGS:-} ;; esac
