#!/usr/bin/env bash
# One device call (one H200, 128 GiB host): the issue-5 1M sparse step with offload and per-layer
# checkpointing (without checkpointing the host tier needs ~99 GiB of pinned memory, over the
# planner's 75% budget on this host), after a warm-up that compiles every kernel; then the CUDA
# offload tests (write-back pieces, two copy streams) if time is left.
#   LEN (default 1048576), T_STEP (python time limit, s), CKPT (1: --checkpoint-layers), TAG, T_TEST (0: no tests),
#   EXTRA (more bench_sparse.py arguments, e.g. "--gpu-page-budget 135426"),
#   PRE_TESTS (test files run first, e.g. tests/test_page_gather.py) with -k PRE_K (default cuda), OOMB_OFFLOAD_STAGE_GRAIN (head|page)
set -u
. benchmarks/gpu_common.sh
gpu_env
free -g | tee "$R/free.txt"
[ -n "${PRE_TESTS:-}" ] && el "pre-tests: $PRE_TESTS" && timeout 150 python3 -m pytest -q $PRE_TESTS -k "${PRE_K:-cuda}" -p no:cacheprovider 2>&1 | tail -3 | tee "$R/pre_tests.txt"
ck=""; [ "${CKPT:-1}" = 1 ] && ck="--checkpoint-layers"
el "sparse ${LEN:-1048576} offload $ck"
timeout ${T_STEP:-470} python3 benchmarks/bench_sparse.py --model qwen2.5-7b --lengths ${LEN:-1048576} --systems sparse \
  --offload on $ck --progress --out "$R" --tag "${TAG:-_1m_ckpt_h200}" ${EXTRA:-} 2>&1 | grep -Ev "$F" | tr '\r' '\n' > "$R/console${TAG:-_1m_ckpt_h200}.txt"
grep -Ev "chunk/s\]|s/chunk\]" "$R/console${TAG:-_1m_ckpt_h200}.txt" | tail -30
[ "${T_TEST:-60}" -gt 0 ] && el "cuda offload tests (torch attention)" && timeout ${T_TEST:-60} python3 -m pytest -q tests/test_offload.py -k "cuda and torch" -p no:cacheprovider 2>&1 | tail -3 | tee "$R/cuda_offload_tests.txt"
el done
[ "$R" = "$OUT" ] || tar czf "$OUT/results.tgz" -C "$R" .
