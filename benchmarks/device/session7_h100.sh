#!/usr/bin/env bash
# Session 7, H100: the MiniGPT attention grid (freezes packs/H100/minigpt_block.json), then
# the full `kharness bench` in 2 rounds. Writes straight under $OUT (a cut run keeps its
# part): logs, the bench tables, the pack.
set -u
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > $OUT/env.txt
timeout 100 python3 -m harness run configs/minigpt_attn_grid.yaml --json > $OUT/mg_attn.json 2> $OUT/mg_attn.log
echo "attn grid rc=$?"; python3 benchmarks/device/summ.py $OUT/mg_attn.json
cp packs/H100/minigpt_block.json $OUT/pack_minigpt_block.json
timeout 440 python3 -m harness bench --rounds 2 --budget-s 430 --out $OUT/b > $OUT/bench.log 2>&1
echo "bench rc=$?"; tail -3 $OUT/bench.log
for f in bench.md bench.json lookup.json decorator.json; do cp $OUT/b/*/$f $OUT/ 2>/dev/null; done; rm -rf $OUT/b
grep -A8 "## minigpt" $OUT/bench.md | grep "tuned\|compile sdpa"
