#!/usr/bin/env bash
# One device call on nvidia-h200-x2, two jobs at once:
#  GPU 0: the CUDA offload tests, then bench_offload.py parts a (peak memory vs length, minimum
#         GPU tier) and b (offload overhead at 128K) for the Qwen2.5-7B shape (issue 4).
#  GPU 1: one full sparse step at 1,048,576 tokens with offload (issue 5): per-layer
#         checkpointing and a fixed GPU page pool (120,000 pages) leaving headroom, after the
#         first attempt (planner-sized pool, no checkpointing) ran out of memory in Stage 2.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_CACHE_DIR=$PWD/.triton_cache TRITON_CACHE_AUTOTUNING=1
[ -f triton_cache.tgz ] && tar xzf triton_cache.tgz
OUT=${OUT:-benchmarks/results/tmp}
mkdir -p "$OUT"
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch,transformers,triton;print('torch',torch.__version__,'transformers',transformers.__version__,'triton',triton.__version__)"
  free -g | head -2; } | tee "$OUT/env.txt"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout ${T_TEST:-80} python3 -m pytest -q -p no:cacheprovider tests/test_offload.py -k cuda > "$OUT/cuda_offload_tests.txt" 2>&1
  el "GPU0 tests rc=$?"; tail -3 "$OUT/cuda_offload_tests.txt"
  timeout ${T_OFF:-470} python3 benchmarks/bench_offload.py --model qwen2.5-7b --parts a b --lengths 32768 65536 98304 131072 \
    --overhead-len 131072 --gpu-page-budget min --out "$OUT" > /tmp/off.txt 2>&1
  el "GPU0 bench_offload rc=$?"
) &
(
  export CUDA_VISIBLE_DEVICES=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  timeout ${T_1M:-560} python3 benchmarks/bench_sparse.py --model qwen2.5-7b --lengths 1048576 --systems sparse --offload on \
    --gpu-page-budget 120000 --checkpoint-layers --warmup-len 8192 --progress --out "$OUT" --tag _1m > /tmp/1m.txt 2>&1
  el "GPU1 1M rc=$?"
) &
wait
grep -Ev 'warn|Warn' /tmp/off.txt | tail -40 > "$OUT/offload_console.txt"; cat "$OUT/offload_console.txt"
tr '\r' '\n' < /tmp/1m.txt | grep -Ev 'warn|Warn|chunk/s\]$|^\s*$' | tail -25 > "$OUT/sparse_1m_console.txt"
tr '\r' '\n' < /tmp/1m.txt | grep "chunk/s\]$" | tail -2 >> "$OUT/sparse_1m_console.txt"; cat "$OUT/sparse_1m_console.txt"
el done; ls -la "$OUT"
