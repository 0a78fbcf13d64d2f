#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (issue 6, and issue 5's 1M-token row):
#  1. `oomb train` under torchrun on 2 GPUs: Qwen2.5-7B shape, LoRA rank 16, sparse (64-page
#     budget), 256K tokens per GPU per step, the bundled corpus.
#  2. then, at the same time: the same run on ONE GPU (GPU 0), the scaling baseline; and on
#     GPU 1 one sparse step at 1,048,576 tokens with offload (bench_sparse.py).
# Per-GPU tokens/s = the logged tokens_per_s / ranks. Step 1 of each run includes compilation.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_CACHE_DIR=$PWD/.triton_cache TRITON_CACHE_AUTOTUNING=1
OUT=${OUT:-benchmarks/results/tmp}
mkdir -p "$OUT"
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch,transformers,triton;print('torch',torch.__version__,'transformers',transformers.__version__,'triton',triton.__version__)"
  free -g | head -2; nproc; } | tee "$OUT/env.txt"
F='warn|Warn|USDT|profiler_st'
TRAIN="-m oomb train --model qwen2.5-7b --device cuda --seq-len 262144 --chunk-size 4096 --sparse --page-budget 64
  --lora-rank 16 --lr 1e-4 --steps ${STEPS:-2} --log-every 1 --no-progress --overwrite"
el "2 GPUs"
timeout ${T_DP:-260} torchrun --standalone --nproc_per_node 2 $TRAIN --output-dir /tmp/dp2 2>&1 | grep -Ev "$F" | tail -8
cp /tmp/dp2/log.jsonl "$OUT/dp_2gpu_log.jsonl"
el "1 GPU (GPU 0) and 1M sparse (GPU 1)"
( CUDA_VISIBLE_DEVICES=0 timeout ${T_1G:-200} python3 $TRAIN --output-dir /tmp/dp1 > /tmp/dp1.txt 2>&1; el "1 GPU done" ) &
( CUDA_VISIBLE_DEVICES=1 timeout ${T_1M:-420} python3 benchmarks/bench_sparse.py --model qwen2.5-7b --lengths 1048576 \
    --systems sparse --offload auto --warmup-len 8192 --progress --out "$OUT" --tag _1m > /tmp/1m.txt 2>&1; el "1M done" ) &
wait
grep -Ev "$F" /tmp/dp1.txt | tail -6; cp /tmp/dp1/log.jsonl "$OUT/dp_1gpu_log.jsonl"
grep -Ev "$F" /tmp/1m.txt | tail -30 > "$OUT/sparse_1m_console.txt"; cat "$OUT/sparse_1m_console.txt"
el "done"
tar czf /tmp/tc.tgz .triton_cache && split -b 15m /tmp/tc.tgz "$OUT/triton_cache.tgz.part-"
ls -la "$OUT"
