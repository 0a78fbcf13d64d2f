#!/usr/bin/env bash
# One device call (one H200), issue 3 after dk/dv v5 and the key-tile alignment hint:
#  1. forward A/B in one process: this tree's kernel vs the kernel of commit 4343a07 (before the
#     segmented past), file given as OLD_FWD (default benchmarks/_old_fwd_4343a07.py, made with
#     `git show 4343a07:oomb/ops/triton_paged_attention.py`);
#  2. bf16 end-to-end parity of the Triton backend (benchmarks/check_gpu_parity.py);
#  3. the dense end-to-end rows, HF vs oomb-triton, at 32K / 64K / 128K (bench_step.py; LENGTHS adds
#     e.g. 262144, where HF is skipped). PARITY=0 skips step 2.
# Everything under $OUT is packed into one tar (the device tool returns only a few files).
set -u
. benchmarks/gpu_common.sh
gpu_env
el "A/B forward"
timeout ${T_AB:-90} python3 benchmarks/ab_forward.py --old ${OLD_FWD:-benchmarks/_old_fwd_4343a07.py} --out "$R" 2>&1 | grep -Ev "$F" | tail -4
if [ "${PARITY:-1}" = 1 ]; then
  el "parity"
  timeout ${T_PAR:-120} python3 benchmarks/check_gpu_parity.py --backends triton --out "$R" 2>&1 | grep -Ev "$F" | tail -3
fi
el "e2e"
timeout ${T_E2E:-330} python3 benchmarks/bench_step.py --model qwen2.5-7b --lengths ${LENGTHS:-32768 65536 131072} \
  --hf-max-len 131072 --systems hf oomb-triton --warmup-len 8192 --out "$R" --tag ${TAG:-_v5} 2>&1 | grep -Ev "$F" | tail -12
el "done"
tar czf "$OUT/results.tgz" -C "$R" .
tar czf /tmp/tc.tgz .triton_cache 2>/dev/null && split -b 15m /tmp/tc.tgz "$OUT/triton_cache.tgz.part-"
ls -la "$OUT"
