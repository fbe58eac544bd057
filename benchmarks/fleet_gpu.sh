#!/usr/bin/env bash
# The fleet's measurements on a GPU machine, each from an empty Triton cache. Parts
# (PARTS, comma-separated; default all of them):
#   probe     Ray's own start (a bare ray.init()) and a GPU worker's, on this machine
#             (benchmarks/startup_probe.py): what the first-trial target is set against;
#   scaling   the scaling benchmark (benchmarks/fleet_scaling.py) on $GPUS GPUs, each
#             count a command with a Ray of its own (cold);
#   warm      the same on a `ray start` fleet with kept workers, each count twice (the
#             second run is the warm one);
#   quickstart `kharness run configs/quickstart.yaml` on one GPU: cold (a Ray of its
#             own), then twice on a `ray start` fleet with kept workers;
#   softmax   a user's own kernel (benchmarks/outside: the tutorial softmax at 12
#             studies, copied into an empty directory) on 1 GPU and on all $GPUS's last
#             (last: it may take its whole limit, SOFTMAX_S; a run stopped there still
#             writes its --json, how far it got).
# Usage: OUT=<folder> GPUS=1,2,4 PARTS=probe,scaling bash benchmarks/fleet_gpu.sh
# Writes into $OUT: device.txt and, per part, its JSON summaries and logs. With
# TARBALL=<file.tgz>, $OUT is packed into it after each run and every 20 s, so that a
# command stopped at a time limit keeps what it measured in one file.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-/tmp/fleet-gpu}"
GPUS="${GPUS:-1,2,4}"
PARTS="${PARTS:-probe,scaling,warm,softmax,quickstart}"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d /tmp/fleet-gpu-XXXX)"
MAX_GPUS="${GPUS##*,}"
ALL_GPUS="$(seq -s, 0 $((MAX_GPUS - 1)))"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{ date -u +"%Y-%m-%d %H:%M:%S UTC"; nvidia-smi -L; nproc; "$PY" -c "import triton, torch;\
print('triton', triton.__version__, 'torch', torch.__version__)"; \
  echo "git ${HARNESS_GIT_SHA:-unknown}"; } > "$OUT/device.txt" 2>&1
want() { [[ ",$PARTS," == *",$1,"* ]]; }
checkpoint() {
  if [ -n "${TARBALL:-}" ]; then
    tar czf "$TARBALL.part" -C "$(dirname "$OUT")" "$(basename "$OUT")" && mv "$TARBALL.part" "$TARBALL"
  fi
}
stamp() { "$PY" -c "import time; print(time.monotonic())"; }

# One `python -m harness run` from $dir: name, experiment, GPUs, limit, extra arguments.
# Its --json summary goes to $OUT/<name>.json, its wall and stderr's tail to <name>.log.
# At the limit only the command is signalled (--foreground), as a user's Ctrl-C would:
# signalled as a process group, Ray's processes died with it and the summary lost what
# they held (the compile service's figures).
one_run() {
  local name=$1 exp=$2 gpus=$3 limit=$4; shift 4
  local t0 t1 rc
  t0=$(stamp)
  (cd "$dir" && CUDA_VISIBLE_DEVICES=$gpus timeout --foreground -k 30 "$limit" "$PY" -m harness run "$exp" \
    --json "$@" > "$OUT/$name.json" 2> "$dir/$name.stderr")
  rc=$?
  t1=$(stamp)
  { echo "command: python -m harness run $exp $* (CUDA_VISIBLE_DEVICES=$gpus, in $dir)";
    echo "exit $rc, wall $("$PY" -c "print(round($t1 - $t0, 2))") s";
    tail -c 6000 "$dir/$name.stderr"; } > "$OUT/$name.log"
  checkpoint
}

# A `ray start` fleet over the given GPUs, its Triton cache $dir/triton-cache.
fleet_up() {
  (cd "$dir" && CUDA_VISIBLE_DEVICES=$1 TRITON_CACHE_DIR="$dir/triton-cache" ray start --head \
    --port 0 --dashboard-host 127.0.0.1 --include-dashboard false --disable-usage-stats \
    --num-gpus "$(echo "$1" | tr ',' '\n' | wc -l)" > "$dir/ray-start.log" 2>&1)
}
# The head, and the kept drivers its runs left (each would end on its own once its Ray is
# gone, or after keep_workers_s).
fleet_down() { ray stop --force > /dev/null 2>&1; pkill -f harness.cli.kept_server; }
if [ -n "${TARBALL:-}" ]; then
  ( while sleep 20; do checkpoint; done ) &
  PACKER=$!
  trap 'kill $PACKER 2> /dev/null; checkpoint' EXIT
fi

if want probe; then
  timeout 200 "$PY" "$ROOT/benchmarks/startup_probe.py" --out "$OUT/probe.json" \
    > /dev/null 2> "$OUT/probe.log"
  checkpoint
fi
if want scaling; then
  timeout "${SCALING_S:-330}" "$PY" "$ROOT/benchmarks/fleet_scaling.py" --gpus "$GPUS" \
    --out "$OUT/scaling" --work "$WORK/scaling" > "$OUT/scaling.log" 2>&1
  checkpoint
fi
if want warm; then
  timeout "${WARM_S:-420}" "$PY" "$ROOT/benchmarks/fleet_scaling.py" --gpus "$GPUS" --warm \
    --out "$OUT/warm" --work "$WORK/warm" > "$OUT/warm.log" 2>&1
  fleet_down
  checkpoint
fi
if want quickstart; then
  dir="$WORK/quickstart-cold"; mkdir -p "$dir"
  TRITON_CACHE_DIR="$dir/triton-cache" one_run quickstart_cold "$ROOT/configs/quickstart.yaml" \
    0 "${QUICKSTART_S:-90}"
  dir="$WORK/quickstart-warm"; mkdir -p "$dir"
  fleet_up 0
  # As from a user's shell after `ray start`: no RAY_AUTH_MODE (the run sends the token
  # that `ray start` wrote).
  ( unset RAY_AUTH_MODE
    for i in $(seq 1 "${WARM_RUNS:-3}"); do
      one_run "quickstart_warm$i" "$ROOT/configs/quickstart.yaml" 0 "${QUICKSTART_S:-90}" \
        --fresh --set fleet.keep_workers_s=600
    done )
  fleet_down
fi
if want softmax; then
  for gpus in $(printf '%s\n' 0 "$ALL_GPUS" | uniq); do  # once where GPUS=1
    n=$(echo "$gpus" | tr ',' '\n' | wc -l)
    dir="$WORK/softmax$n"; mkdir -p "$dir"
    cp "$ROOT/benchmarks/outside/mymod.py" "$ROOT/benchmarks/outside/softmax_12.yaml" "$dir/"
    TRITON_CACHE_DIR="$dir/triton-cache" one_run "softmax_${n}gpu" softmax_12.yaml "$gpus" \
      "${SOFTMAX_S:-150}"
  done
fi
for f in "$OUT"/*.log; do echo "== $f"; tail -n 3 "$f"; done
