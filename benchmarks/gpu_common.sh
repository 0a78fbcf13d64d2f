# Sourced by the one-call GPU scripts (gpu_e2e_v5.sh, gpu_sparse_quality.sh, gpu_copy_streams.sh):
# environment, result folder $R, elapsed-time echo `el`, the log filter $F, the triton cache carried in
# as triton_cache.tgz.part-*, and `gpu_env` (GPU and versions into $R/env.txt).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_CACHE_DIR=$PWD/.triton_cache TRITON_CACHE_AUTOTUNING=1
OUT=${OUT:-benchmarks/results/tmp}
R=${R:-/tmp/res}; mkdir -p "$R" "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
F='warn|Warn|USDT'
gpu_env() {
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch,transformers,triton;print('torch',torch.__version__,'transformers',transformers.__version__,'triton',triton.__version__)"
  } | tee "$R/env.txt"
}
ls triton_cache.tgz.part-* >/dev/null 2>&1 && cat triton_cache.tgz.part-* | tar xz
