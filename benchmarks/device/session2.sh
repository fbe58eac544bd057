#!/usr/bin/env bash
# Device session 2: GPU tests of the zoo families, then tuning runs that freeze the zoo
# packs, all against one `ray start --head` (each run joins it through RAY_ADDRESS).
# Usage: session2.sh [configs...]  (default: configs/zoo/*.yaml). Results land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"; } > $OUT/logs/env.txt 2>&1
cat $OUT/logs/env.txt
T0=$(date +%s)
timeout ${GPU_TEST_S:-150} python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests} > $OUT/logs/pytest_gpu.txt 2>&1
echo "pytest rc=$?"; tail -15 $OUT/logs/pytest_gpu.txt
ray start --head --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1 --include-dashboard=false > $OUT/logs/ray_start.txt 2>&1
export RAY_ADDRESS=127.0.0.1:6379
cfgs=("$@"); [ ${#cfgs[@]} -eq 0 ] && cfgs=(configs/zoo/*.yaml)
for cfg in "${cfgs[@]}"; do
  name=$(basename $cfg .yaml)
  left=$(( ${BUDGET_S:-520} - ($(date +%s) - T0) ))
  if [ $left -lt 30 ]; then echo "skip $name: out of time"; continue; fi
  timeout $left python3 -m harness run $cfg --json > $OUT/logs/$name.json 2> $OUT/logs/$name.log
  echo "$name rc=$? ($(( $(date +%s) - T0 )) s)"
  python3 - $OUT/logs/$name.json <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("  no summary:", e); sys.exit()
for r in d["rows"]:
    print(f"  {r['shape']} {r['dtype']}: best {r.get('latency_ms')} ms, eager {r.get('eager_latency_ms')}, "
          f"default {r.get('default_latency_ms')}, counts {r['counts']}, fail {r['failures'][:1]}")
PY
done
ray stop > /dev/null 2>&1
tar -czf $OUT/packs.tar.gz packs
tar -czf $OUT/logs.tar.gz -C $OUT logs
