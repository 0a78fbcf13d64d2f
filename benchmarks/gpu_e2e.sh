#!/usr/bin/env bash
# One device call: bf16 parity of the attention backend(s), `oomb train` on the bundled text with
# 128K-token sequences, then the step benchmark (HF vs oomb). Results land in $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results/tmp}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch,transformers,triton;print('torch',torch.__version__,'transformers',transformers.__version__,'triton',triton.__version__)"
} | tee "$OUT/env.txt"
python3 benchmarks/check_gpu_parity.py --backends ${PARITY_BACKENDS:-triton} --out "$OUT" 2>&1 | grep -v -i warn | tail -3
grep -q '"pass": true' "$OUT/gpu_parity.json" || { echo "parity failed: not benchmarking"; exit 1; }
if [ "${TRAIN:-1}" = 1 ]; then
  python3 -m oomb train --model qwen2.5-0.5b --device cuda --seq-len 131072 --chunk-size 4096 --steps ${TRAIN_STEPS:-3} \
    --lr 3e-4 --output-dir /tmp/oomb-train --overwrite --no-progress 2>&1 | grep -v -i warn | tail -6
  cp /tmp/oomb-train/log.jsonl "$OUT/train_log.jsonl" 2>/dev/null
fi
python3 benchmarks/bench_step.py --model qwen2.5-7b --lengths ${LENGTHS:-32768 65536 131072 262144} \
  --hf-max-len 131072 --systems hf oomb-triton --warmup-len 8192 --out "$OUT" 2>&1 | grep -v -i warn | tail -12
