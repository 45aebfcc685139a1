# Shared by the GPU evidence scripts. `setup BUNDLE DEFAULT_DEST [OUTDIR]` sets dest (OUTDIR, else $OUT, else
# DEFAULT_DEST), a fresh work folder and the bundle's name, and puts the repository on PYTHONPATH. `step NAME SECONDS
# CMD...` runs CMD with a time limit, logs it to $work/NAME.log, appends its status and tail to $work/summary.log, and
# bundles $work into $dest/$bundle after every step, so a run cut short still returns what it measured.
# `sample_clocks` writes the GPU's SM clock, power and what holds the clock down to $work/clocks.csv every 250 ms
# until the script exits (each step's line in summary.log says when it started).
setup() {
  bundle=$1
  dest=${3:-${OUT:-$2}}
  work=$(mktemp -d)
  mkdir -p "$dest"
  export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
}
step() {
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS started
  started=$(date +%T)
  timeout "$secs" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  [ -z "$(tail -c 1 "$work/$name.log")" ] || echo >>"$work/$name.log"  # a log cut mid-line still ends its line
  echo "== $name rc=$rc $((SECONDS - t0))s (from $started)" | tee -a "$work/summary.log"
  tail -n "${TAIL:-25}" "$work/$name.log" | tee -a "$work/summary.log"
  tar czf "$dest/$bundle" -C "$work" . && cp "$work/summary.log" "$dest/summary.log"
}
sample_clocks() {
  command -v nvidia-smi >/dev/null || return 0
  local fields=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu
  # the throttle field's name changed across drivers: take whichever this one knows
  for reason in clocks_event_reasons.active clocks_throttle_reasons.active; do
    if nvidia-smi --query-gpu=$reason --format=csv >/dev/null 2>&1; then fields=$fields,$reason; break; fi
  done
  nvidia-smi --query-gpu=$fields --format=csv -lms 250 >"$work/clocks.csv" 2>&1 &
  clocks_pid=$!
  trap 'kill $clocks_pid 2>/dev/null' EXIT
}
