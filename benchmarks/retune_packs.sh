#!/usr/bin/env bash
# Re-tunes every shipped pack on this machine's GPUs with the current code, then installs the
# new packs as the shipped ones (harness/packs/shipped/<GPU>/) and re-renders the bench.
#
# Usage (repository root, the GPUs of one type visible):
#   OUT=<folder> bash benchmarks/retune_packs.sh            # every pack experiment
#   OUT=<folder> bash benchmarks/retune_packs.sh configs/zoo/silu.yaml ...   # some of them
#   OUT=<folder> bash benchmarks/retune_packs.sh --serial [...]   # one run per experiment
#   LIMIT_S=540 WORK=/tmp/rt-work OUT=<folder> bash benchmarks/retune_packs.sh   # bounded
#   RESUME=1 LIMIT_S=540 WORK=/tmp/rt-work OUT=<folder> bash benchmarks/retune_packs.sh
#
# LIMIT_S stops the campaign with SIGTERM after that many seconds (a machine lent for a
# limited time): the experiments that finished have written their packs, which are copied
# out as after a full run, and RESUME=1 with the same WORK goes on with the others
# (`kharness run ... --resume`). TARBALL=<file.tgz> packs $OUT and the packs written so far
# into one file every 20 s and at the end, so that a command stopped from outside keeps
# them.
#
# The experiments run as ONE campaign (`kharness run A.yaml B.yaml ...`): one Ray, one set
# of GPU workers and one compile service per node for all their studies, spread over every
# GPU. `--serial` runs them one `kharness run` after another instead, as this script did
# before campaigns (the comparison of the two is timed in summary.txt).
#
# Each experiment runs with `--fresh` into a scratch packs folder seeded with the shipped
# packs, so that the shipped winner is re-measured beside the search's finalists and a
# config is replaced only by one measured faster in the same run. Writes into $OUT: the
# campaign's `campaign.json` (its `--json` summary) and `campaign.log`, or with --serial
# one `<experiment>.json` and `.log` per experiment; `summary.txt` (exit codes, wall
# seconds), the new packs under `packs/<GPU>/`, and `device.txt`. Exit status: the
# campaign's exit code, or with --serial the number of failed runs.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-/tmp/retune}"
PY="${PYTHON:-python3}"
WORK="${WORK:-$(mktemp -d /tmp/retune-XXXX)}"
mkdir -p "$OUT" "$WORK"
LIMIT=()
[ -n "${LIMIT_S:-}" ] && LIMIT=(timeout -s TERM -k 120 "$LIMIT_S")
checkpoint() {
  if [ -n "${TARBALL:-}" ]; then
    tar czf "$TARBALL.part" "$OUT" "$WORK/packs" 2> /dev/null; mv "$TARBALL.part" "$TARBALL"
  fi
}
if [ -n "${TARBALL:-}" ]; then
  ( while sleep 20; do checkpoint; done ) &
  PACKER=$!
  trap 'kill $PACKER 2> /dev/null; checkpoint' EXIT
fi
START=--fresh
[ "${RESUME:-0}" = "1" ] && START=--resume

SERIAL=0
if [ "${1:-}" = "--serial" ]; then
  SERIAL=1
  shift
fi

if [ "$#" -gt 0 ]; then
  EXPERIMENTS=("$@")
else
  # The experiments whose studies write the shipped packs (output.packs_dir: packs); the
  # MiniGPT block's pack comes from its attention grid (zoo/minigpt_block.yaml is the
  # quick TPE version of the same space).
  EXPERIMENTS=(configs/zoo/silu.yaml configs/zoo/silu_mul.yaml configs/zoo/softplus_clamp.yaml
               configs/zoo/rmsnorm.yaml configs/zoo/mulsum.yaml configs/zoo/mulsum_states.yaml
               configs/zoo/mulsum_c_states.yaml configs/zoo/mulsum_ydiag.yaml
               configs/zoo/selective_scan.yaml configs/zoo/selective_scan_fp16.yaml
               configs/minigpt_attn_grid.yaml configs/matmul_grid216.yaml
               configs/grouped_gemm_small_m.yaml configs/grouped_gemm_moe.yaml
               configs/zoo/mamba2_ssd.yaml)
fi
PATHS=()
for exp in "${EXPERIMENTS[@]}"; do
  case "$exp" in /*) PATHS+=("$exp") ;; *) PATHS+=("$ROOT/$exp") ;; esac
done

{ date -u +"%Y-%m-%d %H:%M:%S UTC"; nvidia-smi -L 2>/dev/null; "$PY" -c "import triton, torch;\
print('triton', triton.__version__, 'torch', torch.__version__)"; \
  echo "git $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo "${HARNESS_GIT_SHA:-unknown}")"; } \
  > "$OUT/device.txt" 2>&1

GPU="$("$PY" -c "from harness.measure.hardware import current_device; print(current_device().key)")"
if [ "$START" = --fresh ] || [ ! -d "$WORK/packs/$GPU" ]; then
  mkdir -p "$WORK/packs"
  cp -r "$ROOT/harness/packs/shipped/$GPU" "$WORK/packs/" 2>/dev/null || mkdir -p "$WORK/packs/$GPU"
fi

SETS=(--set "output.packs_dir=$WORK/packs" --set "output.runs_dir=$WORK/runs"
      --set "tracking.uri=sqlite:///$WORK/mlflow.db")
t_all=$(date +%s)
if [ "$SERIAL" -eq 1 ]; then
  failed=0
  for exp in "${PATHS[@]}"; do
    name="$(basename "$exp" .yaml)"
    t0=$(date +%s)
    (cd "$WORK" && "${LIMIT[@]}" "$PY" -m harness run "$exp" "$START" --json "${SETS[@]}" \
       > "$OUT/$name.json" 2> "$OUT/$name.log")
    rc=$?
    echo "$exp: exit $rc, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
  done
  status=$failed
  mode="serial, ${#PATHS[@]} runs"
else
  (cd "$WORK" && "${LIMIT[@]}" "$PY" -m harness run "${PATHS[@]}" "$START" --json "${SETS[@]}" \
     > "$OUT/campaign.json" 2> "$OUT/campaign.log")
  status=$?
  mode="one campaign"
fi
echo "retune ($mode): ${#PATHS[@]} experiments, exit $status, $(( $(date +%s) - t_all )) s" \
  | tee -a "$OUT/summary.txt"

mkdir -p "$OUT/packs" "$OUT/runs"
cp -r "$WORK/packs/$GPU" "$OUT/packs/"
# Each experiment's Optuna storage and state (kilobytes): what its trials measured. The
# storage through SQLite's backup: a plain copy leaves out what is still in its -wal file.
for d in "$WORK"/runs/*/; do
  [ -d "$d" ] || continue  # no runs (the files were refused)
  name="$(basename "$d")"
  mkdir -p "$OUT/runs/$name"
  cp "$d"state.json "$OUT/runs/$name/" 2>/dev/null
  [ -f "$d"optuna.db ] && "$PY" -c "import sqlite3, sys
src, dst = sqlite3.connect(sys.argv[1]), sqlite3.connect(sys.argv[2])
src.backup(dst)" "$d"optuna.db "$OUT/runs/$name/optuna.db"
done
echo "new packs: $OUT/packs/$GPU; install them with"
echo "  cp $OUT/packs/$GPU/*.json harness/packs/shipped/$GPU/ && kharness bench --out benchmarks/results" \
     "&& python benchmarks/render_readme.py"
exit "$status"
