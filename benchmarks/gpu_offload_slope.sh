#!/usr/bin/env bash
# One short device call (H200): bench_offload.py part a with the minimum GPU tier = two default
# 32K-token staging segments (512 pages for page 128), i.e. a GPU page pool of fixed size.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-benchmarks/results/tmp}; mkdir -p "$OUT"
python3 -c "import torch,transformers,triton;print('torch',torch.__version__,'transformers',transformers.__version__,'triton',triton.__version__)" | tee "$OUT/env.txt"
timeout ${T_OFF:-320} python3 benchmarks/bench_offload.py --model qwen2.5-7b --parts a --lengths 32768 49152 65536 98304 \
  --gpu-page-budget min --out "$OUT" --tag _fixedpool 2>&1 | grep -Ev 'warn|Warn' | tail -16
