#!/usr/bin/env bash
# Device session 5. Phases, each optional, picked by PHASES:
#   diag     where compile-ahead misses (diag_compile_ahead.py) and where start-up goes
#            (diag_startup.py)
#   tests    GPU tests: GPU_TESTS="files" GPU_K="-k expression" (default: the fleet's
#            and the grouped GEMM's files)
#   ggmini   24 grouped-GEMM configs through the harness, first launch vs compile-ahead
#   grid     the 216-config bf16 matmul grid at 8192^3 on this GPU, once per entry of
#            GRID_SPECS ("standalone|joined:full|mf"; each from an empty Triton cache)
#   gpus     the grid on 1 and on 2 GPUs of this box (GPU_COUNTS="1 2")
#   sweeps   exhaustive sweeps for the replay benchmark (record_sweeps.sh): SWEEPS="..."
# Everything lands in $OUT/all.tar.gz (the device returns at most 8 files).
DEFAULT_PHASES=diag
source "$(dirname "$0")/common.sh"

if has diag; then
  timeout 240 python3 benchmarks/device/diag_compile_ahead.py > $R/logs/diag_compile_ahead.json 2> $R/logs/diag_compile_ahead.log
  echo "diag compile-ahead rc=$? t=$(el)"; tail -5 $R/logs/diag_compile_ahead.log
  timeout 120 python3 benchmarks/device/diag_startup.py > $R/logs/diag_startup.json 2> $R/logs/diag_startup.log
  echo "diag startup rc=$? t=$(el)"; cat $R/logs/diag_startup.json
fi
if has ggmini; then
  # 24 configs of the grouped-GEMM decode sweep through the harness: first-call vs
  # compile-ahead times per trial (is the worker's first launch loading or compiling?)
  timeout 200 python3 -m harness run configs/sweeps/grouped_gemm_decode.yaml --json \
      --set search.trials=24 --set name=ggmini > $R/logs/ggmini.json 2> $R/logs/ggmini.log
  echo "ggmini rc=$? t=$(el)"; summ $R/logs/ggmini.json
  python3 - <<'PY'
import glob, json, optuna
s = optuna.get_all_study_summaries("sqlite:///runs/ggmini/optuna.db")
st = optuna.load_study(study_name=s[0].study_name, storage="sqlite:///runs/ggmini/optuna.db")
for t in st.trials:
    r = t.user_attrs.get("result") or {}
    x = r.get("extra", {})
    print(t.number, "first", round(r.get("compile_s") or 0, 3), "ahead", x.get("precompile"), "fc", x.get("first_call"))
PY
fi
if has tests; then
  timeout ${TEST_S:-240} python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 \
      ${GPU_TESTS:-tests/test_fleet_gpu.py tests/test_grouped_gemm.py} ${GPU_K:+-k "$GPU_K"} \
      > $R/logs/pytest_gpu.txt 2>&1
  echo "tests rc=$? t=$(el)"; tail -25 $R/logs/pytest_gpu.txt
fi
if has grid; then
  # GRID_SPECS: runs of the grid, each "standalone|joined:full|mf" (mf: multi-fidelity,
  # search.pruner=threshold). Every run starts from an empty Triton cache; a joined run
  # gets a `ray start --head` of its own (started with that cache dir: its workers
  # inherit the head's environment, not the driver's).
  i=0
  for spec in ${GRID_SPECS:-standalone:full}; do
    i=$((i+1)); mode=${spec%%:*}; fid=${spec#*:}
    set_args=""; [ "$fid" = mf ] && set_args="--set search.pruner=threshold"
    cache=/tmp/triton-grid-$i; rm -rf $cache
    log=$R/logs/grid216_${i}_${mode}_${fid}
    if [ "$mode" = joined ]; then
      TRITON_CACHE_DIR=$cache ray start --head --node-ip-address=127.0.0.1 --include-dashboard=false > $log.ray_start.txt 2>&1
      TRITON_CACHE_DIR=$cache RAY_ADDRESS=127.0.0.1:6379 timeout 150 python3 -m harness run configs/matmul_grid216.yaml --json $set_args > $log.json 2> $log.log
      rc=$?; ray stop > /dev/null 2>&1
    else
      TRITON_CACHE_DIR=$cache timeout 150 python3 -m harness run configs/matmul_grid216.yaml --json $set_args > $log.json 2> $log.log
      rc=$?
    fi
    echo "grid $i $mode $fid rc=$rc t=$(el)"; summ $log.json
    python3 -c "import json; d=json.load(open('$log.json')); print('   first_calls', d.get('first_calls'), 'winner', d['rows'][0].get('winner_reason'))" 2>/dev/null
    [ -f runs/matmul-grid216/optuna.db ] && cp runs/matmul-grid216/optuna.db $log.optuna.db
  done
fi
if has gpus; then
  # The same grid on 1 and on 2 GPUs of this box (GPU_COUNTS, default "1 2"), standalone,
  # each from an empty Triton cache.
  for n in ${GPU_COUNTS:-1 2}; do
    vis=$(seq -s, 0 $((n-1)))
    cache=/tmp/triton-gpus-$n; rm -rf $cache
    log=$R/logs/grid216_${n}gpu
    CUDA_VISIBLE_DEVICES=$vis TRITON_CACHE_DIR=$cache timeout 150 python3 -m harness run configs/matmul_grid216.yaml --json > $log.json 2> $log.log
    echo "grid on $n GPU(s) rc=$? t=$(el)"; summ $log.json
    python3 -c "import json; d=json.load(open('$log.json')); r=d['rows'][0]; n=sum(r['counts'][k] for k in ('measured','failed')); print('   trials', n, 'trials/h', round(n*3600/d['wall_s']), 'per GPU-hour', round(n*3600/d['gpu_held_s']), 'first_calls', d.get('first_calls'))" 2>/dev/null
    [ -f runs/matmul-grid216/optuna.db ] && cp runs/matmul-grid216/optuna.db $log.optuna.db
  done
fi
if has sweeps; then  # record_sweeps.sh starts its own `ray start --head`
  BUDGET_S=${SWEEP_S:-150} timeout $(( ${SWEEP_S:-150} + 20 )) bash benchmarks/device/record_sweeps.sh ${SWEEPS:-} > $R/logs/sweeps.log 2>&1
  echo "sweeps rc=$? t=$(el)"; tail -8 $R/logs/sweeps.log
  [ -d "$OUT/replay" ] && mv $OUT/replay $R/; [ -d "$OUT/replay_logs" ] && mv $OUT/replay_logs $R/logs/
fi
cp -r packs $R/ 2>/dev/null
for d in runs/*/; do [ -f $d/optuna.db ] && mkdir -p $R/runs/$(basename $d) && cp $d/optuna.db $R/runs/$(basename $d)/; done
tar -czf $OUT/all.tar.gz -C $OUT r && rm -rf $R
echo "done t=$(el)"; ls -la $OUT
