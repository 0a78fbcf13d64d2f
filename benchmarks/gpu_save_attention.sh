#!/usr/bin/env bash
# One device call (one H200), issue 3: the dense step with save_attention (Stage 1's attention outputs kept,
# so the Stage-2 recompute skips its attention forward) next to the recomputing engine and HF, in one run.
# PART (one or more, in order): e2e (default): SYSTEMS at LENGTHS (T_E2E s). PART=tests: the CUDA tests of save_attention and the
# kernel test file with one config per kernel (T_TEST s). PART=long: SYSTEMS at 256K (HF skipped).
# PART=profile: SYSTEMS timed at LENGTHS, then one step each under torch.profiler at PROFILE_LEN.
# Carry the Triton cache of the previous call (triton_cache.tgz.part-*).
set -u
. benchmarks/gpu_common.sh
gpu_env
for part in ${PART:-e2e}; do
case "$part" in
e2e)
  el "e2e"
  timeout ${T_E2E:-420} python3 benchmarks/bench_step.py --model qwen2.5-7b --lengths ${LENGTHS:-32768 65536 131072} \
    --hf-max-len 131072 --systems ${SYSTEMS:-hf oomb-triton oomb-triton-save-gpu oomb-triton-save-host} --warmup-len 8192 \
    --out "$R" --tag ${TAG:-_save_attention} 2>&1 | grep -Ev "$F" | tail -16 ;;
tests)
  el "tests on the GPU"
  OOMB_TRITON_CONFIGS=${TEST_CONFIGS:-first} timeout -s INT -k 20 ${T_TEST:-300} python3 -m pytest -v --tb=short -n ${WORKERS:-8} \
    -p no:cacheprovider ${TESTS:-tests/test_saved_attention.py tests/test_triton_kernels.py} -rfE 2>&1 | tee "$R/gpu_tests.txt" | tail -15 ;;
long)
  el "256K"
  timeout ${T_E2E:-420} python3 benchmarks/bench_step.py --model qwen2.5-7b --lengths ${LENGTHS:-262144} \
    --hf-max-len 131072 --systems ${SYSTEMS:-oomb-triton-save-host oomb-triton} --warmup-len 8192 --oomb-steps ${OOMB_STEPS:-1} \
    --out "$R" --tag ${TAG:-_save_attention_256k} 2>&1 | grep -Ev "$F" | tail -8 ;;
profile)
  el "profile"
  timeout ${T_E2E:-420} python3 benchmarks/bench_step.py --model qwen2.5-7b --lengths ${LENGTHS:-32768} \
    --systems ${SYSTEMS:-hf oomb-triton-save-gpu} --warmup-len 8192 --oomb-steps ${OOMB_STEPS:-2} \
    --profile ${PROFILE_LEN:-32768} --out "$R" --tag ${TAG:-_profile} 2>&1 | grep -Ev "$F" | tail -8 ;;
esac
done
el "done"
[ "$R" = "$OUT" ] || tar czf "$OUT/results.tgz" -C "$R" .
tar czf /tmp/tc.tgz .triton_cache 2>/dev/null && split -b 15m /tmp/tc.tgz "$OUT/triton_cache.tgz.part-"
