#!/usr/bin/env bash
# One device call (one H200), issue 3: the backward's tensor-descriptor (TMA) loads.
#  1. bench_kernels with OOMB_BWD_TMA=0 OOMB_DKDV_TMA=0 (dq past tiles and dk/dv q/dout tiles gathered,
#     the kernels of 2026-12-01), timing only;
#  2. bench_kernels with both on (the default), with the correctness table;
#  3. the dense end-to-end rows, HF vs oomb-triton, at LENGTHS (default 32K and 128K) with the default.
# PAST (default 32768,131072) sets the kernel benchmark's past lengths.
set -u
. benchmarks/gpu_common.sh
gpu_env
mkdir -p "$R/off" "$R/on"
el "kernels, backward TMA off"
OOMB_BWD_TMA=0 OOMB_DKDV_TMA=0 timeout ${T_OFF:-150} python3 benchmarks/bench_kernels.py --past ${PAST:-32768,131072} \
  --smoke-past 0 --skip-correctness --out "$R/off" 2>&1 | grep -Ev "$F" | tail -8
el "kernels, backward TMA on"
timeout ${T_ON:-200} python3 benchmarks/bench_kernels.py --past ${PAST:-32768,131072} --smoke-past 0 --out "$R/on" 2>&1 \
  | grep -Ev "$F" | tail -8
el "e2e"
timeout ${T_E2E:-220} python3 benchmarks/bench_step.py --model qwen2.5-7b --lengths ${LENGTHS:-32768 131072} \
  --hf-max-len 131072 --systems hf oomb-triton --warmup-len 8192 --out "$R" --tag ${TAG:-_bwdtma} 2>&1 | grep -Ev "$F" | tail -12
el "done"
tar czf "$OUT/results.tgz" -C "$R" .
tar czf /tmp/tc.tgz .triton_cache 2>/dev/null && split -b 15m /tmp/tc.tgz "$OUT/triton_cache.tgz.part-"
ls -la "$OUT"
