#!/usr/bin/env bash
# One device call (one H200): offload's two copy streams (host->device and device->host concurrently).
#  1. the CUDA offload tests with the PyTorch attention (real streams, bitwise vs all-on-device);
#  2. copy bandwidth of pinned host memory: each direction alone, both on one stream, both on two;
#  3. a 256K sparse step with offload forced to the smallest GPU pool (whole-layer staging, R = 0, so
#     the step is copy-heavy), with OOMB_OFFLOAD_COPY_STREAMS=1 (one stream, as before) and 2 (ORDER),
#     each after a warm-up step of WARMUP tokens (default 64K: an 8K warm-up leaves kernels to compile).
set -u
. benchmarks/gpu_common.sh
el "cuda offload tests (torch attention)"
timeout ${T_TEST:-60} python3 -m pytest -q tests/test_offload.py -k "cuda and torch" -p no:cacheprovider 2>&1 | tail -3 | tee "$R/cuda_offload_tests.txt"
el "copy duplex"
timeout 60 python3 benchmarks/bench_copy_duplex.py --gib 2 --out "$R" 2>&1 | grep -Ev "$F"
for n in ${ORDER:-1 2}; do
  el "256K sparse, offload, ${n} copy stream(s)"
  OOMB_OFFLOAD_COPY_STREAMS=$n timeout ${T_STEP:-240} python3 benchmarks/bench_sparse.py --model qwen2.5-7b --lengths ${LEN:-262144} \
    --systems sparse --offload on --gpu-page-budget ${BUDGET:-4096} --warmup-len ${WARMUP:-65536} --out "$R" --tag _copystreams$n 2>&1 | grep -Ev "$F" | grep "^| sparse"
done
el done
[ "$R" = "$OUT" ] || tar czf "$OUT/results.tgz" -C "$R" .
