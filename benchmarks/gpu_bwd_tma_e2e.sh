#!/usr/bin/env bash
# One device call (one H200), issue 3, after gpu_bwd_tma.sh: the dense end-to-end rows with the
# backward's descriptor loads (HF vs oomb-triton at LENGTHS), then the kernel and Triton-engine test
# files on the GPU with one config per kernel (OOMB_TRITON_CONFIGS=first; T_TEST seconds, 0 skips them;
# T_E2E=0 skips the e2e rows; TESTS overrides the test files). Carry the Triton cache of the previous call.
set -u
. benchmarks/gpu_common.sh
gpu_env
if [ "${T_E2E:-240}" -gt 0 ]; then
el "e2e"
timeout ${T_E2E:-240} python3 benchmarks/bench_step.py --model qwen2.5-7b --lengths ${LENGTHS:-32768 65536 131072} \
  --hf-max-len 131072 --systems hf oomb-triton --warmup-len 8192 --out "$R" --tag ${TAG:-_bwdtma} 2>&1 | grep -Ev "$F" | tail -12
fi
if [ "${T_TEST:-300}" -gt 0 ]; then
  el "kernel + engine tests on the GPU"
  OOMB_TRITON_CONFIGS=${TEST_CONFIGS:-first} timeout -s INT -k 20 ${T_TEST:-300} python3 -m pytest -v --tb=short -n ${WORKERS:-8} -p no:cacheprovider ${TESTS:-tests/test_triton_kernels.py tests/test_engine_triton.py} -rfE 2>&1 \
    | tee "$R/gpu_tests.txt" | tail -15
fi
el "done"
[ "$R" = "$OUT" ] || tar czf "$OUT/results.tgz" -C "$R" .
tar czf /tmp/tc.tgz .triton_cache 2>/dev/null && split -b 15m /tmp/tc.tgz "$OUT/triton_cache.tgz.part-"
