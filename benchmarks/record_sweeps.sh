#!/usr/bin/env bash
# Record the exhaustive sweeps of the replay benchmark (harness/search/replay.py) on this GPU box:
# every sweep experiment runs against one `ray start --head` (each run joins it through
# RAY_ADDRESS), within BUDGET_S seconds, then every study is exported to
# $OUT/replay/<HW>/<kernel>__<shape>__<dtype>.json (.json.gz for a large table) with the
# device, the date and the commit: copy those into benchmarks/replay/.
#
# Usage: record_sweeps.sh [config[:seconds] ...]   (default: the list below, in order)
#        record_sweeps.sh --large                   (configs/sweeps/large/: one campaign)
# A sweep starts only if its estimated seconds are left; one that is already recorded
# completely in runs/ (configs/matmul_grid216.yaml run earlier on this box) is not run
# again. A sweep cut short is exported too but flagged INCOMPLETE (the bench skips it).
#
# --large runs every file of configs/sweeps/large/ as ONE campaign (`kharness run A B ...`:
# one Ray, one fleet, one compile service, the studies spread over all the box's GPUs)
# within BUDGET_S (default 1200 s) less RESERVE_S: its searches stop on their own
# (search.timeout_s) END_S before that, so that finalists are re-measured and the run
# ends cleanly; `timeout` at the limit is the backstop. `python benchmarks/large_sweeps.py`
# gives their sizes and the estimated time. Studies left unfinished are exported as they
# are and listed INCOMPLETE; run it again on the same box (runs/ kept) and the campaign
# continues where it stopped (--resume), e.g. in two calls of BUDGET_S=590 where one
# command may run 10 minutes at most. On another box: $OUT/runs.tgz (the sweeps' Optuna
# storages) extracted in the repository root first. A single sweep cut short goes on alike.
# The commit recorded is HARNESS_GIT_SHA where set (a copy without .git), else git's.
set -uo pipefail
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the output directory}"
LARGE=0
if [ "${1:-}" = "--large" ]; then LARGE=1; shift; fi
BUDGET_S=${BUDGET_S:-$([ $LARGE = 1 ] && echo 1200 || echo 300)}
RESERVE_S=${RESERVE_S:-$([ $LARGE = 1 ] && echo 90 || echo 25)}   # kept for the export
L=$OUT/replay_logs
mkdir -p "$L"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
HARNESS_GIT_SHA=${HARNESS_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export HARNESS_GIT_SHA

# Most wanted first. Seconds: rough wall time on one H200 with 16 cores, start-up included.
DEFAULT=(
  configs/sweeps/grouped_gemm_prefill.yaml:60   # 192 configs (20 pruned), the MoE case
  configs/sweeps/matmul_skinny.yaml:35          # 216 configs (76 pruned), cached binaries
  configs/sweeps/rmsnorm.yaml:30                # 2 x 30 configs, compiled on first launch
  configs/matmul_grid216.yaml:90                # 216 configs (24 pruned), 8192^3
  configs/sweeps/grouped_gemm_decode.yaml:45    # 192 configs, the prefill's binaries
)
items=("$@"); [ ${#items[@]} -eq 0 ] && items=("${DEFAULT[@]}")

{ date -u; echo "commit $HARNESS_GIT_SHA"; nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader;
  python3 -c "import torch, triton, optuna; print('torch', torch.__version__, 'triton', triton.__version__, 'optuna', optuna.__version__)"; } > "$L/env.txt" 2>&1
cat "$L/env.txt"

# START_RAY=0: no shared head (each run starts its own local Ray; for dry runs).
cleanup() { [ "${START_RAY:-1}" = 1 ] && ray stop > /dev/null 2>&1; return 0; }
trap cleanup EXIT
trap 'echo "record_sweeps: terminated at $(el) s"; exit 143' TERM INT
if [ "${START_RAY:-1}" = 1 ]; then
  ray start --head --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1 \
      --include-dashboard=false > "$L/ray_start.txt" 2>&1 || { cat "$L/ray_start.txt"; exit 1; }
  export RAY_ADDRESS=127.0.0.1:6379
fi

names=()
if [ $LARGE = 1 ]; then
  files=(configs/sweeps/large/*.yaml)
  for cfg in "${files[@]}"; do names+=("$(sed -n 's/^name: *//p' "$cfg" | head -1)"); done
  # What this box's Triton and torch make of the spaces (the Gluon engine, addmm(out_dtype=)).
  python3 benchmarks/large_sweeps.py "${files[@]}" > "$L/large_sizes.md" 2>&1 \
      || echo "large_sweeps.py: a study holds fewer than 2,000 valid configs here"
  cat "$L/large_sizes.md"
  # A campaign cut short earlier on this box (runs/ kept) is continued: its measured
  # configs stay, and each grid goes on where it stopped.
  again=()
  for n in "${names[@]}"; do [ -f "runs/$n/optuna.db" ] && again=(--resume); done
  left=$(( BUDGET_S - RESERVE_S - $(el) ))
  search_s=$(( left - ${END_S:-150} ))   # the start (~45 s), re-measurement, MLflow's catch-up
  echo "campaign of ${#files[@]} large sweeps (${names[*]}) ${again[*]}: searches stop after ${search_s} s, killed at ${left} s"
  timeout "$left" python3 -m harness run "${files[@]}" "${again[@]}" --json \
      --set "search.timeout_s=$search_s" > "$L/large.json" 2> "$L/large.log"
  rc=$?
  echo "large campaign rc=$rc t=$(el) s$([ $rc -eq 124 ] && echo ' (cut short)')"
else
  for item in "${items[@]}"; do
    cfg=${item%%:*}; est=${item#*:}; [ "$est" = "$item" ] && est=40
    name=$(sed -n 's/^name: *//p' "$cfg" | head -1)
    names+=("$name")
    if [ -f "runs/$name/optuna.db" ] && python3 -m harness.search.replay check "$cfg" > "$L/$name.check" 2>&1; then
      echo "$name: already recorded ($(cat "$L/$name.check")), t=$(el) s"; continue
    fi
    left=$(( BUDGET_S - RESERVE_S - $(el) ))
    if [ $left -lt "$est" ]; then echo "skip $name: ${left} s left, needs ~${est} s"; continue; fi
    again=(); [ -f "runs/$name/optuna.db" ] && again=(--resume)   # cut short before: go on
    timeout $left python3 -m harness run "$cfg" "${again[@]}" --json > "$L/$name.json" 2> "$L/$name.log"
    rc=$?
    echo "$name rc=$rc t=$(el) s$([ $rc -eq 124 ] && echo ' (cut short)')"
  done
fi
cleanup

python3 -m harness.search.replay export-all --runs runs --out "$OUT/replay" --experiments "${names[@]}" \
    --commit "$HARNESS_GIT_SHA" 2> "$L/export.log" | tee "$L/export.txt"
python3 -m harness.search.replay summary "$OUT/replay" > "$L/summary.jsonl" 2>> "$L/export.log"
python3 - "$L/summary.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    c = json.loads(line)
    print(f"{c['case']}: grid {c['grid']} ({c['ok']} ok/{c['failed']} failed/{c['pruned']} pruned)"
          f"{'' if c['complete'] else ' INCOMPLETE'}, optimum {c['optimum_ms']:.4g} ms "
          f"{c['optimum']}, {c['within_tol']} within 2%, grid GPU time {c['grid_cost_s']:.1f} s")
PY
# The sweeps' Optuna storages, so that one cut short can go on in a later run on a fresh
# machine: `tar xzf runs.tgz` in the repository root there (or carry runs/), then the same
# command continues it (--resume).
tar czf "$OUT/runs.tgz" $(for n in "${names[@]}"; do [ -d "runs/$n" ] && echo "runs/$n"; done) \
    2> /dev/null && echo "storages: $OUT/runs.tgz ($(du -h "$OUT/runs.tgz" | cut -f1))"
echo "record_sweeps done in $(el) s"
