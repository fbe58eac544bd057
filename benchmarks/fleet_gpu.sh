#!/usr/bin/env bash
# The fleet's measurements on a GPU machine, each from an empty Triton cache:
#   1. the scaling benchmark (benchmarks/fleet_scaling.py) on $GPUS GPUs (default 1,2,4);
#   2. `kharness run configs/quickstart.yaml` on one GPU;
#   3. the twelve-study job (configs/scaling/twelve_studies.yaml) on one GPU.
# Usage: OUT=<folder> GPUS=1,2,4 bash benchmarks/fleet_gpu.sh
# Writes into $OUT: device.txt, scaling.json, scaling.md, scaling.log, quickstart.json,
# quickstart.log, twelve.json, twelve.log.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-/tmp/fleet-gpu}"
GPUS="${GPUS:-1,2,4}"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d /tmp/fleet-gpu-XXXX)"
mkdir -p "$OUT"
{ date -u +"%Y-%m-%d %H:%M:%S UTC"; nvidia-smi -L; nproc; "$PY" -c "import triton, torch;\
print('triton', triton.__version__, 'torch', torch.__version__)"; \
  echo "git ${HARNESS_GIT_SHA:-unknown}"; } > "$OUT/device.txt" 2>&1

timeout "${SCALING_S:-330}" "$PY" "$ROOT/benchmarks/fleet_scaling.py" --gpus "$GPUS" --out "$OUT" --work "$WORK/scaling" \
  > "$OUT/scaling.log" 2>&1

one_gpu() {  # name, experiment, limit: one command on GPU 0 from an empty Triton cache
  local dir="$WORK/$1"
  mkdir -p "$dir"
  local t0 t1
  t0=$(date +%s.%N)
  (cd "$dir" && CUDA_VISIBLE_DEVICES=0 TRITON_CACHE_DIR="$dir/triton-cache" \
    timeout "$3" "$PY" -m harness run "$ROOT/$2" --json --set "output.runs_dir=$dir/runs" \
    --set "output.packs_dir=$dir/packs" --set "tracking.uri=sqlite:///$dir/mlflow.db" \
    > "$OUT/$1.json" 2> "$dir/stderr.txt")
  local rc=$?
  t1=$(date +%s.%N)
  { echo "command: kharness run $2 (CUDA_VISIBLE_DEVICES=0, empty Triton cache)";
    echo "exit $rc, wall $("$PY" -c "print(round($t1 - $t0, 2))") s"; tail -c 20000 "$dir/stderr.txt"; } \
    > "$OUT/$1.log"
}
one_gpu quickstart configs/quickstart.yaml "${QUICKSTART_S:-70}"
one_gpu twelve configs/scaling/twelve_studies.yaml "${TWELVE_S:-120}"
tail -n 5 "$OUT"/*.log
