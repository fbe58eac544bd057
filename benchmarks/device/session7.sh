#!/usr/bin/env bash
# Device session 7 (#6). Phases (PHASES), each optional:
#   tests    GPU tests: GPU_TESTS="files" GPU_K="-k expression"
#   bench    the full `kharness bench` (every case, the cost sections), ROUNDS rounds
#   ggbench  `kharness bench --kernel grouped_gemm` alone (the pack as it is)
#   gg       the grouped GEMM TMA grid (configs/grouped_gemm_tma_grid.yaml, exhaustive,
#            freezes packs/<GPU>/grouped_gemm.json), then `kharness bench --kernel
#            grouped_gemm`: the pack's config against the default, eager, torch.compile,
#            torch._grouped_mm and dense cuBLAS, one run
#   mgprof   where the MiniGPT block's time goes (pack config vs torch.compile fp16+SDPA)
#   mg       MiniGPT tuning: MG_EXP="configs/zoo/minigpt_block.yaml:trials ...", then bench
#   msweep   the grouped GEMM M sweep (benchmarks/grouped_gemm_sweep.py)
# Everything lands in $OUT/${ARCHIVE:-all}.tar.gz.
DEFAULT_PHASES="tests gg mgprof"
source "$(dirname "$0")/common.sh"
# The GPU's clocks, power and throttle reasons every 250 ms, for the drift seen in timings.
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 250 > $R/logs/gpu_clocks.csv 2>&1 &
CLOCKS=$!

if has tests; then
  timeout ${TEST_S:-300} python3 -m pytest -q -s -m gpu -p no:cacheprovider --durations=10 \
      ${GPU_TESTS:-tests/test_grouped_gemm.py} ${GPU_K:+-k "$GPU_K"} > $R/logs/pytest_gpu.txt 2>&1
  echo "tests rc=$? t=$(el)"; grep -E "passed|failed|Error" $R/logs/pytest_gpu.txt | tail -8
fi
if has gg; then
  log=$R/logs/gg_grid
  timeout ${GG_S:-300} python3 -m harness run configs/grouped_gemm_tma_grid.yaml --json \
      ${GG_SET:-} > $log.json 2> $log.log
  echo "gg grid rc=$? t=$(el)"; summ $log.json
  python3 -c "import json; d=json.load(open('$log.json')); [print('  ', r.get('params'), r.get('latency_ms'), r.get('winner_reason')) for r in d['rows']]" 2>/dev/null
  [ -f runs/grouped-gemm-tma-grid/optuna.db ] && gzip -c runs/grouped-gemm-tma-grid/optuna.db > $log.optuna.db.gz
  timeout ${BENCH_S:-200} python3 -m harness bench --kernel grouped_gemm --no-cost --rounds ${ROUNDS:-5} --out $R/results > $R/logs/gg_bench.log 2>&1
  echo "gg bench rc=$? t=$(el)"; cat $R/results/*/bench.md 2>/dev/null | grep -A12 "## grouped_gemm"
fi
if has bench; then  # every case of benchmarks/cases.yaml with the committed packs, and the cost sections
  timeout ${FULL_S:-560} python3 -m harness bench --rounds ${ROUNDS:-3} --budget-s ${FULL_BUDGET_S:-480} --out $R/results > $R/logs/bench.log 2>&1
  echo "bench rc=$? t=$(el)"; tail -4 $R/logs/bench.log
fi
if has ggbench; then
  timeout ${BENCH_S:-200} python3 -m harness bench --kernel grouped_gemm --no-cost --rounds ${ROUNDS:-5} --out $R/results > $R/logs/gg_bench.log 2>&1
  echo "gg bench rc=$? t=$(el)"; cat $R/results/*/bench.md 2>/dev/null | grep -A12 "## grouped_gemm"
fi
if has mgprof; then
  for b in ${MG_B:-32}; do
    timeout 240 python3 benchmarks/device/diag_minigpt_profile.py --B $b > $R/logs/mgprof_b$b.txt 2>&1
    echo "mgprof B=$b rc=$? t=$(el)"; grep -v '^{' $R/logs/mgprof_b$b.txt | head -40
  done
fi
if has mg; then
  for spec in ${MG_EXP:-configs/zoo/minigpt_block.yaml:60}; do
    exp=${spec%%:*}; n=${spec#*:}; base=$(basename $exp .yaml)
    timeout ${MG_S:-300} python3 -m harness run $exp --json --set search.trials=$n \
        > $R/logs/mg_$base.json 2> $R/logs/mg_$base.log
    echo "mg $base rc=$? t=$(el)"; summ $R/logs/mg_$base.json
    name=$(python3 -c "import yaml; print(yaml.safe_load(open('$exp'))['name'])")
    [ -f runs/$name/optuna.db ] && gzip -c runs/$name/optuna.db > $R/logs/mg_$base.optuna.db.gz
  done
  timeout ${BENCH_S:-200} python3 -m harness bench --kernel minigpt_block --no-cost --rounds ${ROUNDS:-5} --out $R/results > $R/logs/mg_bench.log 2>&1
  echo "mg bench rc=$? t=$(el)"; cat $R/results/*/bench.md 2>/dev/null | grep -A10 "## minigpt"
fi
if has msweep; then
  timeout ${MSWEEP_S:-240} python3 benchmarks/grouped_gemm_sweep.py --out $R/results > $R/logs/msweep.log 2>&1
  echo "msweep rc=$? t=$(el)"; cat $R/results/grouped_gemm_sweep.md 2>/dev/null | tail -9
fi
kill $CLOCKS 2>/dev/null
cp -r packs $R/ 2>/dev/null
tar -czf $OUT/${ARCHIVE:-all}.tar.gz -C $OUT r && rm -rf $R
echo "done t=$(el)"
