#!/usr/bin/env bash
# One device call (one H200), ready for the session after the tenth: what the tenth session changed without device
# time left to run it.
#  1. CUDA tests: the offload/page-gather CUDA cases (incl. test_cuda_stage1_shadow_bitwise: shadow on vs off in ONE
#     process, full and partial), then the sparse Triton file (incl. the autotune restore-hook check) on the GPU.
#  2. A cold-cache `oomb train --sparse` step of the 7B shape (the dK/dV kernels autotune inside a real offloaded step:
#     the restore hooks and the stream drain of oomb/ops/triton_paged_attention.py run for real), LEN tokens, minimum
#     GPU pool (two layers of staging, nothing resident: every page offloaded). The step must finish with a finite loss.
#  Then the selection's topk path against the two-sort reference on CUDA (bitwise tests, benchmarks/bench_select.py).
#  (The partial-shadow A/B in one process moved to gpu_stash_ab.sh, beside the K/V stash A/B.)
#  The CUDA tests include the eleventh session's K/V stash (test_cuda_kv_stash_bitwise, the stash kernels in
#  test_zero_copy_kernels_on_cuda).
#   LEN (default 65536), T_TESTS (default 240)
set -u
. benchmarks/gpu_common.sh
gpu_env
el "cuda tests"
timeout ${T_TESTS:-240} python3 -m pytest -q -p no:cacheprovider tests/test_offload.py tests/test_page_gather.py -k cuda 2>&1 | tail -4 | tee "$R/cuda_tests_offload.txt"
timeout ${T_TESTS:-240} python3 -m pytest -q -p no:cacheprovider tests/test_sparse_triton.py 2>&1 | tail -4 | tee "$R/cuda_tests_sparse_triton.txt"
el "selection: topk vs the two-sort reference (bitwise, timing)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_sparse_select_property.py -k cuda 2>&1 | tail -3 | tee "$R/cuda_tests_select.txt"
timeout 120 python3 benchmarks/bench_select.py --out "$R/select_h200.json" 2>&1 | grep -Ev "$F" | tail -12 | tee "$R/select_h200.txt"
el "cold-cache oomb train --sparse, ${LEN:-65536} tokens, offload"
TRITON_CACHE_DIR=$(mktemp -d) timeout 300 python3 -m oomb.cli train --device cuda --model qwen2.5-7b --seq-len ${LEN:-65536} \
  --sparse --offload on --gpu-page-budget $(( 2 * ${LEN:-65536} / 128 )) --checkpoint-layers --lora-rank 8 --steps 1 --no-progress \
  --output-dir "$R/cold_train" 2>&1 | grep -Ev "$F" | tail -8 | tee "$R/cold_train.txt"
el done
