#!/usr/bin/env bash
# Device session 4 (one GPU; H100 when lent). Phases, each optional, picked by PHASES:
#   tests   GPU tests of the fleet (real illegal address), matmul, MiniGPT, grouped GEMM
#   grid    the 216-config bf16 matmul grid at 8192^3, exhaustive, on this one GPU
#   zoo     tuning runs that freeze this GPU's packs: ZOO="cfg[:timeout_s] ..." (search
#           time per run; the torch.compile baseline off: `kharness bench` has it)
#   bench   `kharness bench` (every table of the project on this GPU; runs before sweeps)
#   sweeps  exhaustive sweeps for the replay benchmark (record_sweeps.sh)
# Everything lands in $OUT/all.tar.gz (the device returns at most 8 files).
set -uo pipefail
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R/logs $R/results
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
PHASES=${PHASES:-tests grid zoo}
{ date -u; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"; } > $R/logs/env.txt 2>&1
cat $R/logs/env.txt
has() { [[ " $PHASES " == *" $1 "* ]]; }
summ() { python3 benchmarks/device/summ.py "$@"; }

if has tests; then
  timeout ${TEST_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 \
      ${GPU_TESTS:-tests/test_fleet_gpu.py tests/test_matmul.py tests/test_minigpt_block.py tests/test_grouped_gemm.py} \
      > $R/logs/pytest_gpu.txt 2>&1
  echo "tests rc=$? t=$(el)"; tail -25 $R/logs/pytest_gpu.txt
fi
if has grid; then
  # Standalone (its own local Ray, cold Triton cache): the wall time includes every start-up.
  export TRITON_CACHE_DIR=/tmp/triton-grid-cache; rm -rf $TRITON_CACHE_DIR
  timeout 120 python3 -m harness run configs/matmul_grid216.yaml --json > $R/logs/grid216.json 2> $R/logs/grid216.log
  echo "grid rc=$? t=$(el)"; summ $R/logs/grid216.json
  unset TRITON_CACHE_DIR
fi
if has zoo; then
  ray start --head --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1 --include-dashboard=false > $R/logs/ray_start.txt 2>&1
  export RAY_ADDRESS=127.0.0.1:6379
  for item in ${ZOO:-}; do
    cfg=${item%%:*}; t=${item#*:}; [ "$t" = "$item" ] && t=60
    n=$(basename $cfg .yaml)
    left=$(( ${BUDGET_S:-560} - $(el) ))
    if [ $left -lt $(( t + 20 )) ]; then echo "skip $n: ${left} s left"; continue; fi
    timeout $(( t + 120 )) python3 -m harness run $cfg --json --set search.timeout_s=$t --set baselines.compile=false \
        > $R/logs/tune_$n.json 2> $R/logs/tune_$n.log
    echo "zoo $n rc=$? t=$(el)"; summ $R/logs/tune_$n.json
  done
  ray stop > /dev/null 2>&1; unset RAY_ADDRESS
fi
if has bench; then
  timeout $(( ${BENCH_S:-200} + 30 )) python3 -m harness bench --out $R/results --budget-s ${BENCH_S:-200} > $R/logs/bench.log 2>&1
  echo "bench rc=$? t=$(el)"; tail -6 $R/logs/bench.log
  python3 - $R/results <<'PY'
import json, sys, glob
for f in glob.glob(sys.argv[1] + "/*/bench.json"):
    d = json.load(open(f))
    print(f, "cases", len(d["cases"]), "errors", d.get("errors"), "skipped", d.get("skipped"))
    for k in ("tuning", "lookup", "decorator"):
        print(k, json.dumps(d.get(k))[:700])
PY
fi
if has sweeps; then  # record_sweeps.sh starts its own `ray start --head`
  BUDGET_S=${SWEEP_S:-150} timeout $(( ${SWEEP_S:-150} + 20 )) bash benchmarks/device/record_sweeps.sh ${SWEEPS:-} > $R/logs/sweeps.log 2>&1
  echo "sweeps rc=$? t=$(el)"; tail -8 $R/logs/sweeps.log
  [ -d "$OUT/replay" ] && mv $OUT/replay $R/; [ -d "$OUT/replay_logs" ] && mv $OUT/replay_logs $R/logs/
fi
cp -r packs $R/ 2>/dev/null; cp mlflow.db $R/ 2>/dev/null
for d in runs/*/; do [ -f $d/optuna.db ] && mkdir -p $R/runs/$(basename $d) && cp $d/optuna.db $R/runs/$(basename $d)/; done
tar -czf $OUT/all.tar.gz -C $OUT r && rm -rf $R
echo "done t=$(el)"; ls -la $OUT
