#!/usr/bin/env bash
# One device call (one H200), issue 3: the SDPA (cuDNN) chunk attention. PART (in order): kernels (default):
# bench_sdpa_attention.py (correctness against the fp32 reference, speed next to the Triton kernels);
# e2e: bench_step.py SYSTEMS at LENGTHS with HF in the same run; parity: check_gpu_parity.py (engine vs
# full-sequence bf16 training against fp32, both grad_accum_dtype values); tests: TESTS on the GPU.
# Carry the Triton cache of the previous call (triton_cache.tgz.part-*).
set -u
. benchmarks/gpu_common.sh
gpu_env
python3 -c "import numpy; print('numpy', numpy.__version__)" | tee -a "$R/env.txt"
for part in ${PART:-kernels}; do
case "$part" in
kernels)
  el "sdpa kernels"
  timeout ${T_K:-240} python3 benchmarks/bench_sdpa_attention.py --out "$R" --tag "${TAG:-}" 2>&1 | grep -Ev "$F" | tail -60 ;;
e2e)
  el "e2e"
  timeout ${T_E2E:-420} python3 benchmarks/bench_step.py --model qwen2.5-7b --lengths ${LENGTHS:-32768 65536 131072} \
    --hf-max-len 131072 --systems ${SYSTEMS:-hf oomb-sdpa-save-gpu oomb-triton-save-gpu} --warmup-len 8192 \
    --oomb-steps ${OOMB_STEPS:-1} --out "$R" --tag ${TAG:-_sdpa} 2>&1 | grep -Ev "$F" | tail -16 ;;
parity)
  el "parity with full-sequence training (bf16 rule), many chunks"
  timeout ${T_PAR:-240} python3 benchmarks/check_gpu_parity.py --seq-len ${PAR_LEN:-32845} --chunk-size ${PAR_CHUNK:-1024} \
    --backends ${PAR_BACKENDS:-triton sdpa} --grad-accum-dtypes param float32 --out "$R" 2>&1 | grep -Ev "$F" | tail -8 ;;
tests)
  el "tests on the GPU"
  OOMB_TRITON_CONFIGS=${TEST_CONFIGS:-first} timeout -s INT -k 20 ${T_TEST:-300} python3 -m pytest -v --tb=short -n ${WORKERS:-8} \
    -p no:cacheprovider ${TESTS:-tests/test_sdpa_attention.py} -rfE 2>&1 | tee "$R/gpu_tests.txt" | tail -15 ;;
esac
done
el "done"
cp "$R"/* "$OUT"/ 2>/dev/null
