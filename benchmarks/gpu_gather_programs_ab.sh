#!/usr/bin/env bash
# One device call (one H200, 128 GiB host), issue 5: how many SMs (persistent programs) the head-grained
# tile gather/scatter kernels should take. For each P in PROGRAMS, the 1M sparse + offload step of
# gpu_sparse_1m_one_gpu.sh with OOMB_PAGE_GATHER_PROGRAMS=P, cut after ~T_EACH s: enough for Stage 1 and the
# first ~40 Stage-2 chunks, where the copies are largest (1.2 s/chunk with P=32 against 0.78 s of compute,
# 2026-12-01 ninth session). Then the first-40-chunk Stage-2 rate per P from the tqdm lines.
#   PROGRAMS (default "8 16 32"), T_EACH (default 240), LEN (default 1048576)
set -u
. benchmarks/gpu_common.sh
gpu_env
for P in ${PROGRAMS:-8 16 32}; do
  el "OOMB_PAGE_GATHER_PROGRAMS=$P"
  OOMB_PAGE_GATHER_PROGRAMS=$P timeout ${T_EACH:-240} python3 benchmarks/bench_sparse.py --model ${MODEL:-qwen2.5-7b} \
    --lengths ${LEN:-1048576} --systems sparse --offload on --checkpoint-layers --progress --out "$R" --tag "_programs$P" \
    ${EXTRA:-} 2>&1 | grep -Ev "$F" | tr '\r' '\n' > "$R/console_programs$P.txt"
  python3 benchmarks/stage2_rate.py "$R/console_programs$P.txt" --label "programs=$P" | tee -a "$R/programs_ab.txt"
done
el done
[ "$R" = "$OUT" ] || cp "$R"/* "$OUT"/ 2>/dev/null
