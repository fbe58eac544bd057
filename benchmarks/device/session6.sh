#!/usr/bin/env bash
# Device session 6. Phases (PHASES), each optional:
#   tests    GPU tests: GPU_TESTS="files" GPU_K="-k expression"
#   keep     kept workers (fleet.keep_workers_s) on a `ray start --head` of this box:
#            run A (fp16 grid) starts the worker; run B (bf16 grid) leases it with an
#            empty Triton cache for bf16 (nothing of bf16 compiled in any process yet);
#            run C (bf16 again) leases it with everything compiled and loaded.
#   grid     the 216-config bf16 matmul grid at 8192^3, standalone, GRID_RUNS times, each
#            from an empty Triton cache (fraction, wall, winner across runs)
# Everything lands in $OUT/${ARCHIVE:-all}.tar.gz.
DEFAULT_PHASES=grid
source "$(dirname "$0")/common.sh"
winner() { python3 -c "import json; d=json.load(open('$1')); r=d['rows'][0]; print('   winner', r['params'], r.get('winner_reason'), 'remeasured', r.get('remeasured_ms'), 'spread', r.get('remeasure_spread'), 'reused', d.get('workers_reused'), 'first_calls', d.get('first_calls'))" 2>/dev/null; }

if has tests; then
  timeout ${TEST_S:-240} python3 -m pytest -q -s -m gpu -p no:cacheprovider --durations=10 \
      ${GPU_TESTS:-tests/test_fleet_gpu.py} ${GPU_K:+-k "$GPU_K"} > $R/logs/pytest_gpu.txt 2>&1
  echo "tests rc=$? t=$(el)"; grep -E "passed|failed|check of" $R/logs/pytest_gpu.txt | tail -8
fi
if has keep; then
 # KEEP_CYCLES cycles, each with a head of its own and an empty Triton cache;
 # KEEP_SPECS: the runs of a cycle (default A:fp16 B:bf16 C:bf16).
 for cyc in $(seq 1 ${KEEP_CYCLES:-1}); do
  cache=/tmp/triton-keep-$cyc; rm -rf $cache
  TRITON_CACHE_DIR=$cache ray start --head --node-ip-address=127.0.0.1 --include-dashboard=false > $R/logs/keep_ray_start.txt 2>&1
  for spec in ${KEEP_SPECS:-A:fp16 B:bf16 C:bf16}; do
    name=${spec%%:*}; dt=${spec#*:}
    log=$R/logs/keep_$name; [ "${KEEP_CYCLES:-1}" -gt 1 ] && log=$R/logs/keep${cyc}_$name
    TRITON_CACHE_DIR=$cache RAY_ADDRESS=127.0.0.1:6379 timeout 150 python3 -m harness run configs/matmul_grid216.yaml --json \
        --set fleet.keep_workers_s=300 --set "dtypes=[$dt]" --set name=keep-$name > $log.json 2> $log.log
    echo "keep $name $dt rc=$? t=$(el)"; summ $log.json; winner $log.json
    [ -f runs/keep-$name/optuna.db ] && cp runs/keep-$name/optuna.db $log.optuna.db
  done
  ray stop > /dev/null 2>&1
 done
fi
if has grid; then
  for i in $(seq 1 ${GRID_RUNS:-2}); do
    cache=/tmp/triton-grid6-$i; rm -rf $cache
    log=$R/logs/grid216_standalone_$i
    TRITON_CACHE_DIR=$cache timeout 150 python3 -m harness run configs/matmul_grid216.yaml --json > $log.json 2> $log.log
    echo "grid $i rc=$? t=$(el)"; summ $log.json; winner $log.json
    [ -f runs/matmul-grid216/optuna.db ] && cp runs/matmul-grid216/optuna.db $log.optuna.db
  done
fi
cp -r packs $R/ 2>/dev/null
tar -czf $OUT/${ARCHIVE:-all}.tar.gz -C $OUT r && rm -rf $R
echo "done t=$(el)"
