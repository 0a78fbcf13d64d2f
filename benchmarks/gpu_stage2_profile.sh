#!/usr/bin/env bash
# One device call (one H200), issue 5: where Stage-2 time goes with sparse + offload. A CUDA timeline of two
# Stage-2 chunks (benchmarks/profile_offload_stage2.py) at LEN with every page offloaded (the smallest pool),
# then the same step timed (no profiler) for each OOMB_PAGE_GATHER_PROGRAMS value in PROGRAMS.
#   LEN (default 262144), PROGRAMS (default "32 16 8"), POOL (default --min-pool)
set -u
. benchmarks/gpu_common.sh
gpu_env
el "profile ${LEN:-262144}"
timeout 240 python3 benchmarks/profile_offload_stage2.py --length ${LEN:-262144} ${POOL:---min-pool} --out "$R" --tag _profiled \
  2>&1 | grep -Ev "$F" | tail -80
for P in ${PROGRAMS:-32 16 8}; do
  el "OOMB_PAGE_GATHER_PROGRAMS=$P"
  OOMB_PAGE_GATHER_PROGRAMS=$P timeout 200 python3 benchmarks/profile_offload_stage2.py --length ${LEN:-262144} ${POOL:---min-pool} \
    --no-profile --out "$R" --tag _programs$P 2>&1 | grep -Ev "$F" | grep -E '"(seconds|stage1_seconds|stage2_seconds|programs|loss|h2d_bytes|d2h_bytes)"'
done
el done
[ "$R" = "$OUT" ] || cp "$R"/*.json "$OUT"/ 2>/dev/null
