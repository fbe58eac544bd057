set -u
R=$OUT/r; mkdir -p $R
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_measure.py > $R/pytest_gpu_measure.txt 2>&1; echo "tests rc=$?"; tail -1 $R/pytest_gpu_measure.txt
rm -rf runs mlflow.db
timeout 150 python3 -m harness run configs/matmul_grid216.yaml --json > $R/grid216.json 2> $R/grid216.log; echo "grid rc=$?"
python3 benchmarks/device/summ.py $R/grid216.json
python3 - <<'PY' > $R/grid216_clocks.txt
import mlflow, statistics
from mlflow import MlflowClient
c = MlflowClient("sqlite:///mlflow.db")
exp = c.get_experiment_by_name("matmul-grid216")
runs = c.search_runs([exp.experiment_id], "tags.`harness.level` = 'trial'", max_results=1000)
pts = sorted((r.info.start_time, r.data.metrics.get("sm_clock_mhz"), r.data.metrics.get("power_w"), r.data.metrics.get("latency_ms")) for r in runs if "sm_clock_mhz" in r.data.metrics)
print("trials with GPU state", len(pts), "of", len(runs))
if pts:
    clk = [p[1] for p in pts]; pw = [p[2] for p in pts]
    print("SM MHz min/median/max", min(clk), statistics.median(clk), max(clk))
    print("power W min/median/max", round(min(pw)), round(statistics.median(pw)), round(max(pw)))
    q = len(pts) // 4
    for i in range(4):
        part = pts[i*q:(i+1)*q]
        print(f"quarter {i+1}: median SM {statistics.median(p[1] for p in part):.0f} MHz, median power {statistics.median(p[2] for p in part):.0f} W")
PY
cat $R/grid216_clocks.txt
timeout 120 python3 -m harness bench --kernel grouped_gemm --no-cost --rounds 3 --out $R/results > $R/gg_bench.log 2>&1; echo "bench rc=$?"
cp $R/results/*/bench.md $R/gg_bench.md; cp $R/results/*/bench.json $R/gg_bench.json; rm -rf $R/results
grep -A10 "| variant" $R/gg_bench.md
