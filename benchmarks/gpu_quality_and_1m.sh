#!/usr/bin/env bash
# One device call on nvidia-h200-x2, two jobs at once (issue 5):
#  GPU 0: sparse attention quality on a model trained here. A ~100M-parameter Qwen2-shaped model
#         (12 layers, hidden 768, 12 query / 4 KV heads, head dim 64, vocab 32000) is trained
#         from random weights on five of the six bundled novels at 8K tokens, then trained on at
#         64K tokens twice from that checkpoint, dense and sparse (same data order), and
#         evaluated at 64K on the held-out novel (Emma) dense and sparse (budgets 4, 16, 64);
#  GPU 1: one full 1,048,576-token sparse step with offload, planner-sized GPU pool, no
#         per-layer checkpointing, now that Stage 2 stages only the selected pages; then
#         `oomb grad-error` at 16K and 64K on GPU 0's 64K dense model (float32).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_CACHE_DIR=$PWD/.triton_cache TRITON_CACHE_AUTOTUNING=1
OUT=${OUT:-benchmarks/results/tmp}
mkdir -p "$OUT"
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch,transformers,triton;print('torch',torch.__version__,'transformers',transformers.__version__,'triton',triton.__version__)"
  free -g | head -2; } | tee "$OUT/env.txt"
ls triton_cache.tgz.part-* >/dev/null 2>&1 && cat triton_cache.tgz.part-* | tar xz
F='warn|Warn|USDT'
W=/tmp/q
(
  export CUDA_VISIBLE_DEVICES=0
  mkdir -p $W/train && for b in oomb/resources/austen/*.txt; do [ "$(basename $b)" = emma.txt ] || cp "$b" $W/train/; done
  python3 - <<'EOF'
from transformers import Qwen2Config, AutoModelForCausalLM
import torch
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1 << 20,
                  rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                  bos_token_id=1, eos_token_id=2)
m = AutoModelForCausalLM.from_config(cfg)
print("params", sum(p.numel() for p in m.parameters()))
m.save_pretrained("/tmp/q/init")
EOF
  common="--device cuda --chunk-size 4096 --page-size 128 --data $W/train --log-every 25 --no-progress --seed 0"
  el "GPU0 train 8K"
  timeout ${T_TR:-170} python3 -m oomb train --model $W/init $common --seq-len 8192 --steps ${STEPS_8K:-300} --lr 1e-3 \
    --warmup-steps 30 --output-dir $W/m8k > $OUT/quality_train8k.txt 2>&1; el "rc=$?"; tail -4 $OUT/quality_train8k.txt
  for mode in dense sparse; do
    extra=""; [ $mode = sparse ] && extra="--sparse --page-budget 64"
    el "GPU0 train 64K $mode"
    timeout ${T_64:-90} python3 -m oomb train --model $W/m8k $common --seq-len 65536 --steps ${STEPS_64K:-12} --lr 3e-4 \
      --warmup-steps 2 --lr-schedule constant --log-every 1 $extra --output-dir $W/m64k_$mode > $OUT/quality_train64k_$mode.txt 2>&1
    el "rc=$?"; tail -3 $OUT/quality_train64k_$mode.txt; cp $W/m64k_$mode/log.jsonl $OUT/quality_train64k_$mode.jsonl 2>/dev/null
  done
  cp $W/m8k/log.jsonl $OUT/quality_train8k.jsonl 2>/dev/null
  for m in m64k_dense m64k_sparse; do
    el "GPU0 eval $m"
    timeout ${T_EV:-50} python3 -m oomb eval --model $W/$m --data oomb/resources/austen/emma.txt --seq-len 65536 \
      --chunk-size 4096 --budgets 4 16 64 --device cuda --json $OUT/quality_eval64k_$m.json > $OUT/quality_eval64k_$m.txt 2>&1
    el "rc=$?"; cat $OUT/quality_eval64k_$m.txt | grep -Ev "$F" | tail -8
  done
  el "GPU0 done"
) > /tmp/gpu0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  el "GPU1 1M"
  timeout ${T_1M:-420} python3 benchmarks/bench_sparse.py --model qwen2.5-7b --lengths 1048576 --systems sparse --offload on \
    --warmup-len 8192 --progress --out "$OUT" --tag _1m_selected > /tmp/1m.txt 2>&1
  el "GPU1 1M rc=$?"
  # gradient error of sparse vs dense on the model GPU 0 trained at 64K (waits for it)
  while [ ! -f $W/m64k_dense/config.json ] && [ $(( $(date +%s) - t0 )) -lt 430 ]; do sleep 5; done
  for L in 16384 65536; do
    el "GPU1 grad-error $L"
    timeout ${T_GE:-70} python3 -m oomb grad-error --model $W/m64k_dense --data $W/train --seq-len $L --chunk-size 4096 \
      --budgets 4 16 64 --device cuda --dtype float32 --json $OUT/quality_grad_error_$L.json > $OUT/quality_grad_error_$L.txt 2>&1
    el "rc=$?"; grep -Ev "$F" $OUT/quality_grad_error_$L.txt | tail -14
  done
) > /tmp/gpu1.txt 2>&1 &
wait
cat /tmp/gpu0.txt; cat /tmp/gpu1.txt
tr '\r' '\n' < /tmp/1m.txt | grep -Ev "$F|chunk/s\]$|^\s*$" | tail -25 > "$OUT/sparse_1m_console.txt"
tr '\r' '\n' < /tmp/1m.txt | grep "chunk/s\]$" | awk 'NR%16==0' | tail -40 >> "$OUT/sparse_1m_console.txt"; tail -30 "$OUT/sparse_1m_console.txt"
el done
tar czf /tmp/tc.tgz .triton_cache 2>/dev/null && split -b 15m /tmp/tc.tgz "$OUT/triton_cache.tgz.part-"
ls -la "$OUT"
