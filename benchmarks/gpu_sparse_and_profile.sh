#!/usr/bin/env bash
# One device call (H200): Triton sparse kernels vs reference, sparse vs dense steps of the
# Qwen2.5-7B shape at 64K/256K (issue 5), a profile of one dense 32K step next to HF (issue 3),
# and the packed-document kernel change (v4) re-timed. Every part has its own time limit so
# the call returns whatever finished. Triton's compiled kernels and autotuning results are
# cached under .triton_cache and copied to $OUT so a later call can carry them.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. TRITON_CACHE_DIR=$PWD/.triton_cache TRITON_CACHE_AUTOTUNING=1
OUT=${OUT:-benchmarks/results/tmp}
mkdir -p "$OUT"
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch,transformers,triton;print('torch',torch.__version__,'transformers',transformers.__version__,'triton',triton.__version__)"
  free -g | head -2
} | tee "$OUT/env.txt"
F='warn|Warn|USDT|profiler_st'
el "sparse kernels"
timeout ${T_SK:-120} python3 benchmarks/bench_sparse.py --kernels --kernel-past 262144 --out "$OUT" 2>&1 | grep -Ev "$F" | tail -25
el "sparse vs dense steps"
timeout ${T_SE:-260} python3 benchmarks/bench_sparse.py --model qwen2.5-7b --lengths 65536 262144 --dense-max-len 65536 \
  --offload off --out "$OUT" 2>&1 | grep -Ev "$F" | tail -14
el "profile 32K"
timeout ${T_PR:-110} python3 benchmarks/bench_step.py --model qwen2.5-7b --lengths 32768 --systems oomb-triton hf \
  --warmup-len 8192 --profile 32768 --out "$OUT" --tag _profile 2>&1 | grep -Ev "$F" | tail -12
el "kernels v4"
timeout ${T_K:-100} python3 benchmarks/bench_kernels.py --past 32768 --smoke-past 0 --out "$OUT" 2>&1 | grep -Ev "$F" | tail -20
el "done"
tar czf "$OUT/triton_cache.tgz" .triton_cache 2>/dev/null; ls -la "$OUT"
