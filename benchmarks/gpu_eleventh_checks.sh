#!/usr/bin/env bash
# One device call (one H200), ready for the session after the tenth: what the tenth session changed without device
# time left to run it.
#  1. CUDA tests: the offload/page-gather CUDA cases (incl. test_cuda_stage1_shadow_bitwise: shadow on vs off in ONE
#     process, full and partial), then the sparse Triton file (incl. the autotune restore-hook check) on the GPU.
#  2. A cold-cache `oomb train --sparse` step of the 7B shape (the dK/dV kernels autotune inside a real offloaded step:
#     the restore hooks and the stream drain of oomb/ops/triton_paged_attention.py run for real), LEN tokens, minimum
#     GPU pool (two layers of staging, nothing resident: every page offloaded). The step must finish with a finite loss.
#  3. If time is left: the 256K every-page-offloaded step with a partial shadow on and off, in one process
#     (OOMB_OFFLOAD_STAGE1_SHADOW and stage1_shadow_partial), to see whether the tenth session's loss difference
#     was the autotune choice.
#   LEN (default 65536), T_TESTS (default 240)
set -u
. benchmarks/gpu_common.sh
gpu_env
el "cuda tests"
timeout ${T_TESTS:-240} python3 -m pytest -q -p no:cacheprovider tests/test_offload.py tests/test_page_gather.py -k cuda 2>&1 | tail -4 | tee "$R/cuda_tests_offload.txt"
timeout ${T_TESTS:-240} python3 -m pytest -q -p no:cacheprovider tests/test_sparse_triton.py 2>&1 | tail -4 | tee "$R/cuda_tests_sparse_triton.txt"
el "cold-cache oomb train --sparse, ${LEN:-65536} tokens, offload"
TRITON_CACHE_DIR=$(mktemp -d) timeout 300 python3 -m oomb.cli train --device cuda --model qwen2.5-7b --seq-len ${LEN:-65536} \
  --sparse --offload on --gpu-page-budget $(( 2 * ${LEN:-65536} / 128 )) --checkpoint-layers --lora-rank 8 --steps 1 --no-progress \
  --output-dir "$R/cold_train" 2>&1 | grep -Ev "$F" | tail -8 | tee "$R/cold_train.txt"
el "partial shadow on/off, one process"
timeout 400 python3 - <<'PY' 2>&1 | grep -Ev "$F" | tail -6 | tee "$R/partial_shadow_ab.txt"
import sys; sys.argv = ["x"]; sys.path.insert(0, "benchmarks")
import torch
from oomb import Engine, OOMBConfig
from oomb.engine.offload import OffloadedKVStore, min_gpu_pages
from bench_sparse import autotuned_configs, build
m = build("qwen2.5-7b", torch.device("cuda"), torch.bfloat16); m.config.use_cache = False
T = 262144
cfg = OOMBConfig(chunk_size=4096, page_size=128, attention_backend="triton", offload=True, checkpoint_layers=True,
                 sparse=True, page_budget=64, sink_pages=1, local_pages=8, gpu_page_budget=min_gpu_pages(28, T // 128, None))
ids = torch.randint(0, m.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0)).cuda()
OffloadedKVStore.stage1_shadow_partial = True
for shadow in (False, True, False):
    OffloadedKVStore.stage1_shadow = shadow
    e = Engine(m, cfg); out = e.step(ids); m.zero_grad(set_to_none=True)
    print("shadow", shadow, "Sh", e.kv_store.stage1_shadow_pages, "loss", repr(out.loss), "s", round(out.stage1_seconds + out.stage2_seconds, 2), flush=True)
    del e; torch.cuda.empty_cache()
print(autotuned_configs())
PY
el done
