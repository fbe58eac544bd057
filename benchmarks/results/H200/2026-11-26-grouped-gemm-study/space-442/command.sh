python3 -m harness run configs/grouped_gemm_moe.yaml --set 'shapes=[{M: 49152, N: 1408, K: 2048, E: 64}]' --set search.seed_from_packs=false --set search.timeout_s=200 --set output.packs_dir=/root/out/packs --set output.runs_dir=/root/out/runs --json
python3 compare_pack.py /root/out/packs/H200/grouped_gemm.json > /root/out/compare.json
