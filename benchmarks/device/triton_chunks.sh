#!/usr/bin/env bash
# Another Triton for the device, in pieces that fit its per-call carry limit.
#
# The device image has Triton 3.6 and reaches no registry; a newer wheel (3.9.0: 285 MB)
# is over the 64 MiB a call may carry. This script, run here in the repository root,
# downloads the wheel, drops what a Hopper run does not load (the AMD backend's libraries,
# CUPTI, proton, the Blackwell ptxas: the device's CUDA 13 ptxas stands in for it),
# compresses the rest with xz (~106 MB for 3.9.0) and splits it into .tw1/ .tw2/ ...
# (40 MB each: with the ~19 MB of tracked files, one per call stays under the limit).
#
# On the device (a machine stays warm only 30 s after a call, so send the calls back to
# back; the pieces wait in /tmp between them):
#   call 1, carry [".tw1"]:   mkdir -p /tmp/tw && cp .tw1/* /tmp/tw/
#   call 2, carry [".tw2"]:   cp .tw2/* /tmp/tw/
#   call 3, carry [".tw3"]:   cp .tw3/* /tmp/tw/ && mkdir -p /tmp/tnew &&   (the last piece)
#                             cat /tmp/tw/part* | xz -d -T8 | tar -x -C /tmp/tnew
#   then, with .devsite:      export PYTHONPATH=/tmp/tnew:/tmp/site:$PWD
#                             TRITON_PTXAS_BLACKWELL_PATH=/usr/local/cuda/bin/ptxas
#                             TRITON_DEFAULT_FP_FUSION=1
# (Session 17, H200 calls 8-13, 3.9.0; `benchmarks/results/H200/2026-11-24-session17.md`.)
#
#   bash benchmarks/device/triton_chunks.sh [VERSION]
set -euo pipefail
ver="${1:-3.9.0}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work" "triton==$ver"
mkdir "$work/x"
unzip -q "$work"/triton-"$ver"-*.whl -d "$work/x"
nv="$work/x/triton/backends/nvidia"
# Backend discovery imports the AMD backend's Python modules: keep those, drop its libraries.
find "$work/x/triton/backends/amd" -type f -size +1M -delete
rm -rf "$nv/lib/cupti" "$nv/lib/cupti-blackwell" "$nv/bin/ptxas-blackwell" \
    "$work/x/triton/_C/libproton.so"
tar -C "$work/x" -cf - . | xz -T0 -6 > "$work/t.tar.xz"
rm -rf .tw[0-9]*
split -b 40000000 -d "$work/t.tar.xz" "$work/part"
n=1
for p in "$work"/part*; do
    mkdir -p ".tw$n" && mv "$p" ".tw$n/"
    grep -qx "/.tw$n/" .git/info/exclude || echo "/.tw$n/" >> .git/info/exclude
    n=$((n + 1))
done
ls -l .tw*/
