#!/usr/bin/env bash
# Device session 3 (nvidia-h200-x2: two GPUs), phases run side by side, one GPU each:
#   A0 (GPU0): tune MiniGPT + the mul-sum bmm with accuracy requirements -> packs
#   A1 (GPU1): new GPU tests, then the 216-config matmul grid on ONE GPU
#   B0 (GPU0): `kharness bench` (every zoo kernel vs its baselines)
#   B1 (GPU1): exhaustive sweeps for the replay benchmark, then the grouped-GEMM M sweep
#   C  (both): the 216-config grid on TWO GPUs
# Everything lands in $OUT/all.tar.gz.
set -uo pipefail
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R/logs $R/results
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
{ date -u; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"; } > $R/logs/env.txt 2>&1
cat $R/logs/env.txt

phase_a0() {
  export CUDA_VISIBLE_DEVICES=0 MLFLOW_TRACKING_URI=sqlite:///$PWD/mlflow_zoo.db
  for cfg in configs/zoo/minigpt_block.yaml configs/zoo/mulsum.yaml; do
    n=$(basename $cfg .yaml)
    timeout 120 python3 -m harness run $cfg --json > $R/logs/tune_$n.json 2> $R/logs/tune_$n.log
    echo "A0 $n rc=$? t=$(el)"
  done
}
phase_a1() {
  export CUDA_VISIBLE_DEVICES=1
  timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fleet_gpu.py tests/test_matmul.py tests/test_minigpt_block.py tests/test_grouped_gemm.py > $R/logs/pytest_gpu.txt 2>&1
  echo "A1 pytest rc=$? t=$(el)"; tail -3 $R/logs/pytest_gpu.txt
  timeout 70 python3 -m harness run configs/matmul_grid216.yaml --json > $R/logs/grid216_1gpu.json 2> $R/logs/grid216_1gpu.log
  echo "A1 grid216 1-GPU rc=$? t=$(el)"
}
phase_b0() {
  export CUDA_VISIBLE_DEVICES=0
  timeout 220 python3 -m harness bench --out $R/results --budget-s 200 > $R/logs/bench.log 2>&1
  echo "B0 bench rc=$? t=$(el)"; tail -2 $R/logs/bench.log
}
phase_b1() {
  export CUDA_VISIBLE_DEVICES=1
  if [ -f benchmarks/device/record_sweeps.sh ]; then
    BUDGET_S=140 timeout 150 bash benchmarks/device/record_sweeps.sh > $R/logs/sweeps.log 2>&1
    echo "B1 sweeps rc=$? t=$(el)"; tail -3 $R/logs/sweeps.log
  fi
  if [ -f benchmarks/grouped_gemm_sweep.py ]; then
    timeout 75 python3 benchmarks/grouped_gemm_sweep.py --out $R/results/grouped_gemm_msweep --budget-s 30 > $R/logs/msweep.log 2>&1
    echo "B1 msweep rc=$? t=$(el)"; tail -3 $R/logs/msweep.log
  fi
}
phase_a0 & phase_a1 & wait
phase_b0 & phase_b1 & wait
timeout 60 python3 -m harness run configs/matmul_grid216.yaml --json > $R/logs/grid216_2gpu.json 2> $R/logs/grid216_2gpu.log
echo "C grid216 2-GPU rc=$? t=$(el)"
python3 - $R/logs <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(sys.argv[1] + "/grid216_*.json")) + sorted(glob.glob(sys.argv[1] + "/tune_*.json")):
    try:
        d = json.load(open(f))
    except Exception as e:
        print(os.path.basename(f), "no summary", e); continue
    print(os.path.basename(f), "wall", round(d.get("wall_s", 0), 1), "timing_fraction", d.get("timing_fraction"))
    for r in d["rows"]:
        print("   ", r["shape"], r["dtype"], r["hardware"], "best", r.get("latency_ms"), r.get("params"), r["counts"], (r.get("failures") or [""])[:1])
PY
cp -r packs $R/ 2>/dev/null; cp mlflow_zoo.db $R/ 2>/dev/null; cp -r runs/zoo-minigpt-block $R/ 2>/dev/null
[ -d "$OUT/replay" ] && mv $OUT/replay $R/
tar -czf $OUT/all.tar.gz -C $OUT r && rm -rf $R
ls -la $OUT
