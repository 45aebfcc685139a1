# Shared by the GPU evidence scripts. `setup BUNDLE DEFAULT_DEST [OUTDIR]` sets dest (OUTDIR, else $OUT, else
# DEFAULT_DEST), a fresh work folder and the bundle's name, and puts the repository on PYTHONPATH. `step NAME SECONDS
# CMD...` runs CMD with a time limit, logs it to $work/NAME.log, appends its status and tail to $work/summary.log, and
# bundles $work into $dest/$bundle after every step, so a run cut short still returns what it measured.
setup() {
  bundle=$1
  dest=${3:-${OUT:-$2}}
  work=$(mktemp -d)
  mkdir -p "$dest"
  export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
}
step() {
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s" | tee -a "$work/summary.log"
  tail -n "${TAIL:-25}" "$work/$name.log" | tee -a "$work/summary.log"
  tar czf "$dest/$bundle" -C "$work" . && cp "$work/summary.log" "$dest/summary.log"
}
