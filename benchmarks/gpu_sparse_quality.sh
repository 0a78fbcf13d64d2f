#!/usr/bin/env bash
# One device call (one H200), issue 5:
#  1. sparse steps at 64K and 256K (Qwen2.5-7B shape, chunk 4096, budget 64 + sink 1 + local 8, no
#     offload) for the speedup over this project's dense rows of the same session (gpu_e2e_v5.sh);
#  2. a ~100M-parameter Qwen2-shaped model (as in gpu_quality_and_1m.sh) trained from random weights
#     at 8K tokens on five bundled novels, then `oomb grad-error` on it at 16K and 64K tokens,
#     budgets 4 / 16 / 64, float32 with the PyTorch reference attention (no fp32 kernel autotuning).
# Everything under /tmp/res is packed into one tar in $OUT.
set -u
. benchmarks/gpu_common.sh
W=/tmp/q; mkdir -p $W/train
gpu_env
el "sparse steps"
timeout ${T_SP:-200} python3 benchmarks/bench_sparse.py --model qwen2.5-7b --lengths 65536 262144 --systems sparse \
  --offload off --out "$R" --tag ${TAG:-_2026-12-01} 2>&1 | grep -Ev "$F" | tail -8
el "train 8K"
for b in oomb/resources/austen/*.txt; do [ "$(basename $b)" = emma.txt ] || cp "$b" $W/train/; done
python3 - <<'PY'
from transformers import Qwen2Config, AutoModelForCausalLM
import torch
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1 << 20,
                  rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                  bos_token_id=1, eos_token_id=2)
AutoModelForCausalLM.from_config(cfg).save_pretrained("/tmp/q/init")
PY
timeout ${T_TR:-120} python3 -m oomb train --model $W/init --device cuda --chunk-size 4096 --page-size 128 --data $W/train \
  --log-every 25 --no-progress --seed 0 --seq-len 8192 --steps ${STEPS_8K:-300} --lr 1e-3 --warmup-steps 30 \
  --output-dir $W/m8k > $R/grad_error_train8k.txt 2>&1
el "rc=$?"; grep -Ev "$F" $R/grad_error_train8k.txt | tail -3; cp $W/m8k/log.jsonl $R/grad_error_train8k.jsonl 2>/dev/null
for L in 16384 65536; do
  el "grad-error $L"
  timeout ${T_GE:-120} python3 -m oomb grad-error --model $W/m8k --data oomb/resources/austen/emma.txt --seq-len $L \
    --chunk-size 4096 --budgets 4 16 64 --device cuda --dtype float32 --attention-backend torch \
    --json $R/grad_error_$L.json > $R/grad_error_$L.txt 2>&1
  el "rc=$?"; grep -Ev "$F" $R/grad_error_$L.txt | tail -16
done
el done
tar czf "$OUT/results.tgz" -C "$R" .
ls -la "$OUT"
