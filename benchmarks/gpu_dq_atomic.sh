#!/usr/bin/env bash
# One device call (one H200), issue 3: the backward with atomic dq (OOMB_DQ_ATOMIC=1: the past dk/dv kernel also
# atomic_adds ds @ k into an fp32 dq accumulator, 5 products instead of 7) and Triton's warp specialisation
# (OOMB_WS=1), each against the default kernels, timing only, each variant in its own process:
#   VARIANTS (default "base atomic ws ws_atomic"), PAST (default 32768,131072), T_K seconds per variant;
# then the GPU tests of the atomic path (TESTS, T_TEST s, one config per kernel).
set -u
. benchmarks/gpu_common.sh
gpu_env
for v in ${VARIANTS:-base atomic ws ws_atomic}; do
  case "$v" in
    base) envs="" ;; atomic) envs="OOMB_DQ_ATOMIC=1" ;; ws) envs="OOMB_WS=1" ;; ws_atomic) envs="OOMB_WS=1 OOMB_DQ_ATOMIC=1" ;;
  esac
  mkdir -p "$R/$v"
  el "kernels $v ($envs)"
  env $envs timeout ${T_K:-150} python3 benchmarks/bench_kernels.py --past ${PAST:-32768,131072} --smoke-past 0 \
    --skip-correctness --out "$R/$v" 2>&1 | grep -Ev "$F" | tail -${TAIL:-6}
done
if [ "${T_TEST:-0}" != 0 ]; then
  el "tests"
  OOMB_DQ_ATOMIC=1 OOMB_TRITON_CONFIGS=first timeout -s INT -k 20 ${T_TEST} python3 -m pytest -v --tb=short -n ${WORKERS:-8} \
    -p no:cacheprovider ${TESTS:-tests/test_triton_kernels.py} -rfE 2>&1 | tee "$R/gpu_tests_atomic.txt" | tail -15
fi
el "done"
tar czf "$OUT/results.tgz" -C "$R" .
