#!/usr/bin/env bash
# Thirteenth session, one H200 (issue 5). PART=a: the 256K denominator (all pages resident), then the activation
# peak of a 64K sparse + offload step with and without --checkpoint-layers against the planner's estimate (a forced
# pool of 8,192 pages, so pages are offloaded), then the autotune choices (*.autotune.json) packed into
# $OUT/autotune.tgz so later calls time the same kernel configs.
# PART=b: the 1M step with the defaults (the engine sizes the pool), TAG names the run.
# PART=c: only the 64K activation check without --checkpoint-layers (PART=a's second row did not come back: a call
# returns at most 8 files).
set -u
. benchmarks/gpu_common.sh
gpu_env
pack_autotune() { find .triton_cache -name "*.autotune.json" | tar czf "$OUT/autotune.tgz" -T -; }
case "${PART:-a}" in
a)
  LEN=262144 T_TEST=0 TAG=_256k_thirteenth bash benchmarks/gpu_sparse_1m_one_gpu.sh
  for ck in "" "--checkpoint-layers"; do
    el "64K sparse offload pool 8192 $ck"
    timeout 200 python3 benchmarks/bench_sparse.py --model qwen2.5-7b --lengths 65536 --systems sparse --offload on \
      $ck --gpu-page-budget 8192 --out "$R" --tag "_64k_act${ck:+_ckpt}_thirteenth" 2>&1 | grep -Ev "$F" | tail -4
  done
  pack_autotune ;;
b)
  OUT=$OUT R=$R T_TEST=0 TAG=${TAG:-_1m_defaults_thirteenth} bash benchmarks/gpu_sparse_1m_one_gpu.sh
  pack_autotune ;;
c)
  el "64K sparse offload pool 8192, no per-layer checkpointing"
  timeout 200 python3 benchmarks/bench_sparse.py --model qwen2.5-7b --lengths 65536 --systems sparse --offload on \
    --gpu-page-budget 8192 --out "$R" --tag "_64k_act_nockpt" 2>&1 | grep -Ev "$F" | tail -4 ;;
esac
el done
