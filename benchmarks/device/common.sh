# Sourced by the device session scripts: the results folder $R (packed into
# $OUT/all.tar.gz by the caller), the environment record, and small helpers.
# Expects PHASES (default: $DEFAULT_PHASES).
set -uo pipefail
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R/logs $R/results
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
PHASES=${PHASES:-$DEFAULT_PHASES}
{ date -u; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv;
  nproc; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"; } > $R/logs/env.txt 2>&1
cat $R/logs/env.txt
has() { [[ " $PHASES " == *" $1 "* ]]; }
summ() { python3 benchmarks/device/summ.py "$@"; }
