#!/usr/bin/env bash
# One GPU measurement: benchmarks/run_gpu.sh KIND [ARGS...]
#
# Writes the GPU, driver and versions to $OUT/env.txt, then runs the script of KIND with ARGS appended (so any of
# the script's options, and --set KEY=VALUE engine settings where the script takes them, can be given), its output
# also in $OUT/KIND.txt. Results land in $OUT (default benchmarks/results/run). A Triton cache carried in as
# triton_cache.tgz.part-* is unpacked first; TRITON_CACHE_DIR is ./.triton_cache, and autotune results are kept.
#
# KIND        script                                   measures
# tests       pytest ARGS (default: the CUDA tests)   the test suite's CUDA cases on this GPU (autotune: first config)
# parity      check_gpu_parity.py                      bf16 engine vs full-sequence fp32 training, 2 layers, many chunks
# kernels     bench_kernels.py                         Triton paged attention: errors and TFLOP/s next to SDPA
# sdpa        bench_sdpa_attention.py                  the cuDNN (sdpa) chunk attention next to the Triton kernels
# step        bench_step.py                            one dense step, oomb systems next to Hugging Face
# bench       python -m oomb bench                     the same through the CLI
# sparse      bench_sparse.py                          sparse (and dense) steps, with or without offload, 64K-1M
# offload     bench_offload.py                         dense offload: memory vs length, overhead, longest context
# offload-ab  offload_ab.py                            offload settings A/B in one process (staging sets, stash, copies)
# overhead    offload_overhead.py                      dense step all on the GPU vs offloaded (cuDNN, Triton), one process
# sdpa-memory bench_sdpa_memory.py                     the fused attention backward's workspace per past token
# stage2      profile_offload_stage2.py                CUDA timeline of Stage-2 chunks with every page offloaded
# profile-sparse profile_sparse_step.py                GPU time of one sparse step by kernel group (torch.profiler)
# copy        bench_copy_duplex.py                     pinned host<->device bandwidth, one and two streams
# gather      bench_page_gather.py                     the zero-copy tile copy kernels, alone and beside GEMMs
# gather-big  bench_page_gather_big.py                 the same over a 64 GiB pinned tier
# select      bench_select.py                          page selection time
# train       python -m oomb train                     a training run (default: qwen2.5-0.5b at 128K, 3 steps)
# chat-vs-text chat_vs_text.py                         oomb train on a chat set made from the novels vs plain text
# quality     (below)                                  sparse quality: train a 100M model, eval and grad-error at 64K
# dp          (below)                                  data-parallel scaling: torchrun on 2 GPUs against 1
# shard       bench_shard.py                           --shard params/grads-optim on NPROC GPUs (default 2) against 1:
#                                                      s/step, tok/s/GPU, peak/GPU, collective time; largest shape
# finetune    full_finetune.py                         7B full fine-tune per --optimizer (torchao from .whl/ if missing)
# glue        (below)                                  fused_glue none vs liger: bf16 parity, then 7B step times
# retrieval   (below)                                  passkey retrieval trained from scratch dense and sparse, then eval
#
# Examples:
#   benchmarks/run_gpu.sh step --lengths 32768 131072 --systems hf oomb-sdpa-save-gpu --oomb-steps 2
#   benchmarks/run_gpu.sh sparse --lengths 1048576 --systems sparse --offload on --checkpoint-layers --progress
#   benchmarks/run_gpu.sh offload-ab --set sets
#   benchmarks/run_gpu.sh tests tests/engine/test_offload.py -k cuda
#   NPROC=2 benchmarks/run_gpu.sh shard --part step --configs params:2   (one configuration per device call)
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:?usage: benchmarks/run_gpu.sh KIND [ARGS...] (kinds: see the top of this file)}; shift
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TRITON_CACHE_DIR=$PWD/.triton_cache TRITON_CACHE_AUTOTUNING=1
OUT=${OUT:-benchmarks/results/run}; mkdir -p "$OUT"
if ls triton_cache.tgz.part-* >/dev/null 2>&1; then cat triton_cache.tgz.part-* | tar xz; fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no GPU (nvidia-smi not found)"
  python3 -c "import torch,transformers,triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
  free -g | sed -n 2p; date -u +%F; git rev-parse --short HEAD 2>/dev/null || true; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

quality() {  # a 100M Qwen2-shaped model from random weights on five novels (Emma held out); dense and sparse at 64K
  local W=/tmp/oomb-quality common="--device cuda --chunk-size 4096 --data /tmp/oomb-quality/train --no-progress --seed 0"
  mkdir -p $W/train; for b in oomb/resources/austen/*.txt; do [ "$(basename "$b")" = emma.txt ] || cp "$b" $W/train/; done
  python3 - <<'PY'
import torch
from transformers import AutoModelForCausalLM, Qwen2Config
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, max_position_embeddings=1 << 20, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, use_sliding_window=False, bos_token_id=1, eos_token_id=2)
AutoModelForCausalLM.from_config(cfg).save_pretrained("/tmp/oomb-quality/init")
PY
  python3 -m oomb train --model $W/init $common --seq-len 8192 --steps 300 --lr 1e-3 --warmup-steps 30 --log-every 25 --output-dir $W/m8k
  cp $W/m8k/log.jsonl "$OUT/sparse_quality_train_8k.jsonl"
  for mode in dense sparse; do
    extra=""; [ $mode = sparse ] && extra="--sparse --page-budget 64"
    python3 -m oomb train --model $W/m8k $common --seq-len 65536 --steps 12 --lr 3e-4 --warmup-steps 2 --lr-schedule constant \
      $extra --output-dir $W/m64k_$mode
    cp $W/m64k_$mode/log.jsonl "$OUT/sparse_quality_train_64k_$mode.jsonl"
    python3 -m oomb eval --model $W/m64k_$mode --data oomb/resources/austen/emma.txt --seq-len 65536 --chunk-size 4096 \
      --budgets 4 16 64 --device cuda --json "$OUT/sparse_quality_eval_64k_${mode}_trained.json" | tee "$OUT/sparse_quality_eval_64k_${mode}_trained.txt"
  done
  for L in 16384 65536; do
    python3 -m oomb grad-error --model $W/m8k --data oomb/resources/austen/emma.txt --seq-len $L --chunk-size 4096 \
      --budgets 4 16 64 --device cuda --dtype float32 --attention-backend torch --json "$OUT/grad_error_100m_$L.json"
  done
}

glue() {  # fused_glue none vs liger (Liger-Kernel from .whl/ if missing): bf16 parity over 33 chunks, then step A/B
  # (ARGS go to step_ab.py, e.g. --sparse --offload off); GLUE_HF_LENGTHS="32768 ...": then oomb against HF, glue for
  # glue (bench_vs_hf_glue.py, cuDNN attention with saved outputs). The parity check needs an H200: its fp32
  # full-sequence reference over 12,365 tokens ran out of memory on an H100
  if ! python3 -c "import liger_kernel" 2>/dev/null && ls .whl/liger_kernel-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/liger_kernel-*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site; fi
  python3 $B/check_gpu_parity.py --out "$OUT" --chunk-size 384 --backends triton sdpa --fused-glue none liger || true
  python3 $B/step_ab.py --src . --label glue --lengths ${GLUE_LENGTHS:-32768} --steps 3 --fused-glue none liger \
    --out "$OUT/fused_glue_ab.jsonl" "$@"
  if [ -n "${GLUE_HF_LENGTHS:-}" ]; then
    python3 $B/bench_vs_hf_glue.py --lengths $GLUE_HF_LENGTHS --set engine.attention_backend=sdpa \
      --set engine.save_attention=gpu --out "$OUT/bench_vs_hf_glue.jsonl"; fi
}

retrieval() {  # a 100M model trained from random weights on retrieval rows, per mode (ARGS: dense sparse64 sparse16)
  # RKIND=passkey: prompt/completion rows (`oomb data --make passkey`): only the answer and EOS are trained, which is
  # what makes retrieval learnable from random weights (benchmarks/passkey_loss_recipe_cpu.py). RKIND=keyvalue:
  # segments rows (`oomb data --make keyvalue`), the pass key and N secret sentences, every one asked and its answer
  # trained (N + 1 answers per row, at distances over the whole row); RA_NEEDLES / RB_NEEDLES list N per rows file
  # of stage A / stage B (N = 0: passkey rows as segments, so they mix with the others). Stage A, once for
  # every mode: RA_STEPS steps of RA_SEQ tokens (chunk RA_CHUNK) packed from rows of RA_LENS tokens with the
  # document mask. A block of 128 queries reaches at most 6 pages of its rows, fewer than any mode keeps (sink 1 +
  # local 8 + budget), so sparse attention trains them exactly as dense (tests/engine/test_sparse_engine.py,
  # test_packed_documents_that_fit_the_kept_pages_train_as_dense): one dense run serves all modes. Rows of up to
  # 2K from random weights teach nothing (docs/performance.md), so stage A2, also once, lengthens what stage A
  # learnt: RA2_STEPS steps (0: none) of RA_SEQ tokens from rows of RA2_LENS, from stage A's model. Stage B, per
  # mode from the last of these: RB_STEPS steps of RB_SEQ tokens (chunk RCHUNK) packed from rows of RB_LENS (several
  # answers per sequence) in the mode's attention. Then the passkey grid, dense and sparse, to 2x RB_SEQ. The model
  # stage B starts from is read first, dense, at RA_ELENS (empty: not read) into retrieval_eval_a.{md,json}.
  # RPARALLEL=1 runs the modes' stage B side by side on the one GPU (a 100M model leaves it mostly idle; the times
  # and tokens/s of each run are then those of a shared GPU). Sizes come from the environment so that the same
  # script runs small on a CPU (RDEV=cpu RHIDDEN=64 ...). ROPT: the --optimizer of every stage; RSCHED its
  # --lr-schedule (cosine, the default; constant: no decay, which learnt stage A more slowly, docs/performance.md);
  # RMIN_LR its --min-lr-factor (where the cosine ends, as a fraction of the stage's lr; default 0.1); RA_LR and
  # RA_WARMUP stage A's --lr (default 1e-3) and --warmup-steps (default 30).
  # Every stage keeps a checkpoint every RSAVE_EVERY steps (default 250), so that a stage cut short by the device
  # time can still be read: `oomb eval --model` of its output folder reads the latest checkpoint.
  # The rows and each stage's model are kept under RWORK in folders named by a hash of their settings: a second
  # run on the same machine reuses what it can (RSTOP=a: stop after stage A, so that a later call goes on from it)
  # and redoes what a changed setting changes. `oomb train` reads the rows (JSON Lines) with the datasets library: where the
  # GPU image lacks it, carry its wheels (datasets, dill, multiprocess) and install them first.
  local W=${RWORK:-/tmp/oomb-retrieval} dev=${RDEV:-cuda} aseq=${RA_SEQ:-16384} asteps=${RA_STEPS:-1200}
  local achunk=${RA_CHUNK:-8192} bseq=${RB_SEQ:-32768} bsteps=${RB_STEPS:-150} chunk=${RCHUNK:-4096}
  local alens=${RA_LENS:-"128 192 256 320 384 512"} blens=${RB_LENS:-"2048 4096 8192 16384 32000"}
  local a2lens=${RA2_LENS:-"512 768 1024 1536 2048"} a2steps=${RA2_STEPS:-600}
  local elens=${RE_LENS:-"4096 8192 16384 32768 65536"} aelens=${RA_ELENS-"512 768 2048 4096"}
  local common="--device $dev --document-mask --long-examples drop --no-progress --seed 0 --log-every 50 ${ROPT:+--optimizer $ROPT} --lr-schedule ${RSCHED:-cosine} ${RMIN_LR:+--min-lr-factor $RMIN_LR} --save-every ${RSAVE_EVERY:-250}"
  [ $# -gt 0 ] || set -- dense sparse64 sparse16
  for mode in "$@"; do
    case $mode in dense|sparse[0-9]*) ;; *) echo "retrieval: unknown mode $mode (dense, sparseB)" >&2; return 2;; esac
  done
  key() { echo "$*" | md5sum | cut -c1-8; }
  local rows=${RA_ROWS:-12000} rows2=${RA2_ROWS:-6000} seed kind=${RKIND:-passkey} aneed="- - -" bneed="-" n i
  [ "$kind" = keyvalue ] && { aneed=${RA_NEEDLES:-"0 0 4"}; bneed=${RB_NEEDLES:-"30 0"}; }
  needles() { [ "$1" = - ] || echo "--needles $1"; }
  local model="RHIDDEN=${RHIDDEN:-768} RINTER=${RINTER:-2048} RLAYERS=${RLAYERS:-12} RHEADS=${RHEADS:-12}"
  local init=$W/init_$(key $model) short=$W/short_$(key $kind $aneed $alens $rows) mid=$W/mid_$(key $kind $aneed $a2lens $rows2)
  local long=$W/long_$(key $kind $bneed $blens ${RB_ROWS:-450})
  local a=$W/a_$(key $model $kind $aneed $alens $rows $aseq $achunk $asteps ${RA_LR:-1e-3} ${ROPT:-} ${RSCHED:-cosine} ${RMIN_LR:-} ${RA_WARMUP:-})
  local a2=${a}_a2_$(key $a2lens $rows2 $a2steps ${RA2_LR:-5e-4} ${RMIN_LR:-})
  mkdir -p $short $mid $long
  i=0; for n in $aneed; do  # the files made side by side: the short rows are a folder of them
    seed=$((10 + i)); i=$((i + 1))
    [ -f $short/s$seed.jsonl ] || python3 -m oomb data --make $kind $(needles $n) --examples $rows --make-lengths $alens \
      --make-output $short/s$seed.jsonl --seed $seed &
  done
  if [ "$a2steps" -gt 0 ]; then
    for seed in 20 21; do
      [ -f $mid/s$seed.jsonl ] || python3 -m oomb data --make $kind $(needles ${aneed%% *}) --examples $rows2 \
        --make-lengths $a2lens --make-output $mid/s$seed.jsonl --seed $seed &
    done
  fi
  i=0; for n in $bneed; do
    i=$((i + 1))
    [ -f $long/s$i.jsonl ] || python3 -m oomb data --make $kind $(needles $n) --examples ${RB_ROWS:-450} \
      --make-lengths $blens --make-output $long/s$i.jsonl --seed $i &
  done
  [ -d $init ] || env $model RINIT=$init python3 - <<'PY'
import os, torch
from transformers import AutoModelForCausalLM, Qwen2Config
torch.manual_seed(0)
e = lambda k: int(os.environ[k])
cfg = Qwen2Config(vocab_size=32000, hidden_size=e("RHIDDEN"), intermediate_size=e("RINTER"), num_hidden_layers=e("RLAYERS"),
                  num_attention_heads=e("RHEADS"), num_key_value_heads=e("RHEADS") // 3, max_position_embeddings=1 << 20,
                  rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False, bos_token_id=1,
                  eos_token_id=2)
model = AutoModelForCausalLM.from_config(cfg)
print(f"init: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
model.save_pretrained(os.environ["RINIT"])
PY
  wait
  local ta0=$(date +%s)
  [ -f $a/model.safetensors ] || python3 -m oomb train --model $init --data $short $common --seq-len $aseq \
      --chunk-size $achunk --steps $asteps --lr ${RA_LR:-1e-3} --warmup-steps ${RA_WARMUP:-30} --output-dir $a --overwrite \
      2>&1 | tee "$OUT/retrieval_a.txt"
  [ -f $a/model.safetensors ] || { echo "retrieval: stage A failed (see $OUT/retrieval_a.txt)" >&2; return 1; }
  cp $a/log.jsonl "$OUT/retrieval_train_a.jsonl"
  echo "{\"stage\": \"a\", \"stage_a_s\": $(( $(date +%s) - ta0 ))}" | tee -a "$OUT/retrieval_times.jsonl"
  local start=$a
  if [ "$a2steps" -gt 0 ]; then
    ta0=$(date +%s)
    [ -f $a2/model.safetensors ] || python3 -m oomb train --model $a --data $mid $common --seq-len $aseq \
        --chunk-size $achunk --steps $a2steps --lr ${RA2_LR:-5e-4} --warmup-steps 10 --output-dir $a2 --overwrite \
        2>&1 | tee "$OUT/retrieval_a2.txt"
    [ -f $a2/model.safetensors ] || { echo "retrieval: stage A2 failed (see $OUT/retrieval_a2.txt)" >&2; return 1; }
    cp $a2/log.jsonl "$OUT/retrieval_train_a2.jsonl"
    echo "{\"stage\": \"a2\", \"stage_a2_s\": $(( $(date +%s) - ta0 ))}" | tee -a "$OUT/retrieval_times.jsonl"
    start=$a2
  fi
  if [ -n "$aelens" ] && [ ! -f "$OUT/retrieval_eval_a.json" ]; then  # what stage B starts from
    python3 -m oomb eval --task passkey --model $start --device $dev --chunk-size $achunk \
      --lengths $aelens --depths 0 25 50 75 100 --trials ${RE_TRIALS:-2} \
      --json "$OUT/retrieval_eval_a.json" > "$OUT/retrieval_eval_a.md"
    grep "^\*\*\|^| \*\*all\|log-prob" "$OUT/retrieval_eval_a.md"
  fi
  [ "${RSTOP:-}" = a ] && { echo "retrieval: stopped after stage A (RSTOP=a)"; return 0; }
  one() {
    local mode=$1 extra=""; case $mode in sparse*) extra="--sparse --page-budget ${mode#sparse}";; esac
    local b=$W/b_${mode}_$(key $start $long $bseq $bsteps $chunk ${RB_LR:-5e-4} ${RMIN_LR:-}) t1=$(date +%s)
    [ -f $b/model.safetensors ] || python3 -m oomb train --model $start --data $long $common $extra --seq-len $bseq \
      --chunk-size $chunk --steps $bsteps --lr ${RB_LR:-5e-4} --warmup-steps 10 --output-dir $b --overwrite
    cp $b/log.jsonl "$OUT/retrieval_train_b_$mode.jsonl"; local t2=$(date +%s)
    python3 -m oomb eval --task passkey --model $b --device $dev --chunk-size $chunk --lengths $elens \
      --depths 0 25 50 75 100 --trials ${RE_TRIALS:-2} --budgets 16 64 --json "$OUT/retrieval_eval_$mode.json" \
      > "$OUT/retrieval_eval_$mode.md"
    local t3=$(date +%s)
    echo "{\"mode\": \"$mode\", \"parallel\": ${RPARALLEL:-0}, \"stage_b_s\": $((t2-t1)), \"eval_s\": $((t3-t2))}" \
      | tee -a "$OUT/retrieval_times.jsonl"
  }
  if [ "${RPARALLEL:-0}" = 1 ]; then
    for mode in "$@"; do one $mode > "$OUT/retrieval_$mode.txt" 2>&1 & done; wait
  else
    for mode in "$@"; do one $mode 2>&1 | tee "$OUT/retrieval_$mode.txt"; done
  fi
  grep -h "done in\|error" "$OUT"/retrieval_*.txt || true; cat "$OUT"/retrieval_eval_*.md | grep -v "prompt [0-9]*/" || true
  python3 $B/plot_retrieval.py "$OUT" || true
}

dp() {  # 256K sparse LoRA steps on 2 GPUs, then the same on 1 GPU
  local TRAIN="-m oomb train --model qwen2.5-7b --device cuda --seq-len 262144 --chunk-size 4096 --sparse --page-budget 64
    --lora-rank 16 --lr 1e-4 --steps ${STEPS:-2} --no-progress --overwrite"
  torchrun --standalone --nproc_per_node 2 $TRAIN --output-dir /tmp/oomb-dp2 "$@"; cp /tmp/oomb-dp2/log.jsonl "$OUT/data_parallel_2gpu.jsonl"
  CUDA_VISIBLE_DEVICES=0 python3 $TRAIN --output-dir /tmp/oomb-dp1 "$@"; cp /tmp/oomb-dp1/log.jsonl "$OUT/data_parallel_1gpu.jsonl"
}

B=benchmarks
case "$kind" in
  tests)      [ $# -gt 0 ] || set -- tests/engine/test_offload.py tests/ops/test_page_gather.py tests/ops/test_sdpa_attention.py -k cuda
              OOMB_TEST_AUTOTUNE=${OOMB_TEST_AUTOTUNE:-first} python3 -m pytest -v --tb=short -p no:cacheprovider -rfE "$@" ;;
  parity)     python3 $B/check_gpu_parity.py --out "$OUT" "$@" ;;
  kernels)    python3 $B/bench_kernels.py --out "$OUT" "$@" ;;
  sdpa)       python3 $B/bench_sdpa_attention.py --out "$OUT" "$@" ;;
  step)       python3 $B/bench_step.py --out "$OUT" "$@" ;;
  bench)      python3 -m oomb bench --device cuda --model qwen2.5-7b --json "$OUT/oomb_bench.json" "$@" ;;
  sparse)     python3 $B/bench_sparse.py --out "$OUT" "$@" ;;
  offload)    python3 $B/bench_offload.py --out "$OUT" "$@" ;;
  offload-ab) python3 $B/offload_ab.py --out "$OUT" "$@" ;;
  stage2)     python3 $B/profile_offload_stage2.py --out "$OUT" "$@" ;;
  profile-sparse) python3 $B/profile_sparse_step.py --out "$OUT" "$@" ;;
  copy)       python3 $B/bench_copy_duplex.py --out "$OUT" "$@" ;;
  gather)     python3 $B/bench_page_gather.py --out "$OUT" "$@" ;;
  gather-big) python3 $B/bench_page_gather_big.py --out "$OUT" "$@" ;;
  select)     python3 $B/bench_select.py --out "$OUT/page_selection.json" "$@" ;;
  train)      python3 -m oomb train --device cuda --model qwen2.5-0.5b --seq-len 131072 --steps 3 --lr 3e-4 --no-progress \
                --overwrite --output-dir /tmp/oomb-train "$@"; cp /tmp/oomb-train/log.jsonl "$OUT/train_log.jsonl" ;;
  chat-vs-text) python3 benchmarks/chat_vs_text.py --out "$OUT/chat_vs_text.json" "$@" ;;
  quality)    quality "$@" ;;
  dp)         dp "$@" ;;
  shard)      python3 $B/bench_shard.py --nproc "${NPROC:-2}" --out "$OUT/bench_shard.jsonl" "$@" ;;
  retrieval)  retrieval "$@" ;;
  glue)       glue "$@" ;;
  overhead)   python3 $B/offload_overhead.py --out "$OUT/offload_overhead.jsonl" "$@" ;;
  sdpa-memory) python3 $B/bench_sdpa_memory.py --out "$OUT/sdpa_memory.jsonl" "$@" ;;
  finetune)   if ! python3 -c "import torchao.optim" 2>/dev/null && ls .whl/torchao-*.whl >/dev/null 2>&1; then
                python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/torchao-*.whl
                export PYTHONPATH=/tmp/site:$PYTHONPATH; fi
              python3 $B/full_finetune.py --out "$OUT/full_finetune.jsonl" "$@" ;;
  *) echo "run_gpu.sh: unknown KIND '$kind' (see the top of $0)" >&2; exit 2 ;;
esac 2>&1 | tee "$OUT/$kind.txt"
