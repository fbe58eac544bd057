#!/usr/bin/env bash
# Device session 8. Phases (PHASES), each optional:
#   tests    GPU tests: GPU_TESTS="files" GPU_K="-k expression" (TEST_S seconds at most)
#   grid     the 216-config bf16 matmul grid at 8192^3, each run from an empty Triton cache.
#            GRID_SPECS: one run per entry "mode:warmup_ms:rep_ms", mode standalone (the run
#            starts its own Ray), joined (a `ray start --head` started before, not timed) or
#            kept (on such a head, an fp16 run with fleet.keep_workers_s starts the worker,
#            not timed; then the bf16 grid, timed, leases it: nothing of bf16 compiled yet,
#            and its mlflow.db exists, as for a user's second run).
#            The command's own wall (date before and after, the process's imports included)
#            is printed next to the run's `wall_s`.
# Everything lands in $OUT/${ARCHIVE:-all}.tar.gz.
DEFAULT_PHASES="tests grid"
source "$(dirname "$0")/common.sh"
winner() { python3 -c "import json; d=json.load(open('$1')); r=d['rows'][0]; print('   winner', r['params'], r.get('winner_reason'), 'remeasured', r.get('remeasured_ms'), 'spread', r.get('remeasure_spread'), 'first_calls', d.get('first_calls'))" 2>/dev/null; }
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 250 > $R/logs/gpu_clocks.csv 2>&1 &
CLOCKS=$!

if has tests; then
  timeout ${TEST_S:-240} python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 \
      ${GPU_TESTS:-tests/test_fleet_gpu.py} ${GPU_K:+-k "$GPU_K"} > $R/logs/pytest_gpu.txt 2>&1
  echo "tests rc=$? t=$(el)"; grep -E "passed|failed|Error" $R/logs/pytest_gpu.txt | tail -8
fi
if has grid; then
  i=0
  for spec in ${GRID_SPECS:-standalone:15:60 standalone:5:40}; do
    i=$((i+1)); IFS=: read -r mode wu rep <<< "$spec"
    cache=/tmp/triton-grid8-$i; rm -rf $cache runs/matmul-grid216 mlflow.db
    log=$R/logs/grid216_${i}_${mode}_${wu}_${rep}
    env_addr=""; keep=""
    if [ "$mode" != standalone ]; then
      TRITON_CACHE_DIR=$cache ray start --head --node-ip-address=127.0.0.1 --include-dashboard=false > $log.ray_start.txt 2>&1
      env_addr="RAY_ADDRESS=127.0.0.1:6379"
    fi
    if [ "$mode" = kept ]; then
      keep="--set fleet.keep_workers_s=300"
      env $env_addr TRITON_CACHE_DIR=$cache timeout 150 python3 -m harness run configs/matmul_grid216.yaml --json \
          $keep --set "dtypes=[fp16]" > $log.fp16_first.json 2> $log.fp16_first.log
      echo "  kept worker started by an fp16 run rc=$?"
    fi
    t0=$(date +%s.%N)
    env $env_addr TRITON_CACHE_DIR=$cache timeout 150 python3 -m harness run configs/matmul_grid216.yaml --json \
        --set timing.warmup_ms=$wu --set timing.rep_ms=$rep $keep > $log.json 2> $log.log
    rc=$?; t1=$(date +%s.%N)
    echo "grid $i $spec rc=$rc command wall $(python3 -c "print(round($t1-$t0,2))") s t=$(el)"
    summ $log.json; winner $log.json
    python3 -c "import json; print('   worker start-up', json.load(open('$log.json')).get('worker_startup_s'))" 2>/dev/null
    [ "$mode" != standalone ] && ray stop > /dev/null 2>&1
    [ -f runs/matmul-grid216/optuna.db ] && gzip -c runs/matmul-grid216/optuna.db > $log.optuna.db.gz
  done
fi
kill $CLOCKS 2>/dev/null
cp -r packs $R/ 2>/dev/null
tar -czf $OUT/${ARCHIVE:-all}.tar.gz -C $OUT r && rm -rf $R
echo "done t=$(el)"
