import sys, os, tarfile
from benchmarks.device.diag_grouped_steady import S2
from kernels.grouped_gemm import GroupedGemm, make_grouped_inputs
fam = GroupedGemm(); shape = GroupedGemm.shapes["deepseek-v3-16b"]
M,N,K,E = (shape[d] for d in ("M","N","K","E"))
inputs = make_grouped_inputs([M // E] * E, N, K, "bf16", seed=1, device="cuda")
out = os.environ["OUT"]
for name, cfg in {"base": {**S2, "WARP_SPEC": 1}, "wide": {**S2, "WARP_SPEC": 1, "TAIL_WIDE": 1},
                  "base_nows": dict(S2), "wide_nows": {**S2, "TAIL_WIDE": 1}}.items():
    launches, _ = fam._launches(inputs, cfg)
    k = launches[-1].warmup()
    for kind in ("ttgir", "ptx"):
        open(f"{out}/{name}.{kind}", "w").write(k.asm[kind])
    print(name, {kk: len(v) for kk, v in k.asm.items() if isinstance(v, (str, bytes))})
    try:
        import subprocess
        cub = f"{out}/{name}.cubin"; open(cub, "wb").write(k.asm["cubin"])
        sass = subprocess.run(["/usr/local/cuda/bin/cuobjdump", "-sass", cub], capture_output=True, text=True).stdout
        open(f"{out}/{name}.sass", "w").write(sass); os.remove(cub)
    except Exception as e:
        print("sass", e)
with tarfile.open(f"{out}/ir.tgz", "w:gz") as t:
    for f in os.listdir(out):
        if f.endswith(("ttgir", "ptx", "sass")):
            t.add(f"{out}/{f}", arcname=f)
for f in os.listdir(out):
    if f.endswith(("ttgir", "ptx", "sass")):
        os.remove(f"{out}/{f}")
