#!/usr/bin/env bash
# Device session 1: GPU tests of the committed kernel families, then a real grouped-GEMM
# tuning run (configs/grouped_gemm_hopper.yaml). Everything lands in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
timeout 200 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_grouped_gemm.py 2>&1 | tail -25 | tee $OUT/pytest_gpu_grouped_gemm.txt
timeout 330 python3 -m harness run configs/grouped_gemm_hopper.yaml --json > $OUT/run.json 2> $OUT/run.log
echo "run rc=$?"
tail -5 $OUT/run.log
cp packs/*/grouped_gemm.json $OUT/ 2>/dev/null
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/run.json"))
for r in d["rows"]:
    print({k: r.get(k) for k in ("hardware", "shape", "params", "latency_ms", "eager_latency_ms",
                                 "default_latency_ms", "speedup_vs_eager", "speedup_vs_default",
                                 "roofline", "tflops", "counts")})
print("wall_s", d["wall_s"])
PY
