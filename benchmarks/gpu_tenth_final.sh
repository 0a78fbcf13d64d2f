#!/usr/bin/env bash
# One device call (one H200), issue 5, tenth session: (1) the 256K sparse step in the 1M run's configuration
# (offload on, --checkpoint-layers, planner-sized pool: every page resident), the denominator of the 1M cost per
# token, re-measured on this code; (2) the Stage-2 copy-kernel load size (ELEMS in oomb.ops.triton_page_gather) at
# 256K with every page offloaded, against 8192 (86.67 s in gpu_stage2_profile.sh of the same session).
#   ELEMS (default "2048 32768")
set -u
. benchmarks/gpu_common.sh
gpu_env
el "sparse 262144 offload on --checkpoint-layers"
timeout 200 python3 benchmarks/bench_sparse.py --model qwen2.5-7b --lengths 262144 --systems sparse --offload on \
  --checkpoint-layers --out "$R" --tag _256k_offload_ckpt_h200_2026-12-01_tenth 2>&1 | grep -Ev "$F" | grep -E '^\| sparse|seconds' | tail -3
for E in ${ELEMS:-2048 32768}; do
  el "min pool, ELEMS_PER_LOAD=$E"
  timeout 170 python3 benchmarks/profile_offload_stage2.py --length 262144 --min-pool --no-profile --elems-per-load $E \
    --out "$R" --tag _elems$E 2>&1 | grep -Ev "$F" | grep -E '"(seconds|stage1_seconds|stage2_seconds|elems_per_load|loss)"'
done
el done
