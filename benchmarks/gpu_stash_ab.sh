#!/usr/bin/env bash
# One device call (one H200): the K/V stash and the partial Stage-1 shadow, A/B in ONE process (so that every run
# shares the autotuned kernel configs), on the issue-5 shape with every page offloaded: Qwen2.5-7B shape, bf16,
# LEN (default 262144) tokens, chunk 4096, budget 64+1+8, per-layer checkpointing, the minimum GPU pool (two
# layers of staging, nothing resident). Runs, in order: baseline; stash (STASH_MIB, default 16384: every tile of
# every layer at 256K); partial shadow; baseline again (noise, and bitwise-equal losses).
# Prediction (written before the run, eleventh session): the stash removes the backward's K/V re-read, a quarter
# of the Stage-2 host->device bytes (26 of 28 layers): h2d_bytes -24%, Stage 2 a few seconds faster (its offload
# overhead at 256K min pool is ~24 s, half of it waiting on copies). Losses bitwise equal in all four runs.
set -u
. benchmarks/gpu_common.sh
gpu_env
el "stash / partial shadow A/B, ${LEN:-262144} tokens, min pool"
R="$R" LEN=${LEN:-262144} STASH_MIB=${STASH_MIB:-16384} timeout ${T_AB:-560} python3 - <<'PY' 2>&1 | grep -Ev "$F" | tee "$R/stash_ab.txt"
import json, os, sys, time; sys.argv = ["x"]; sys.path.insert(0, "benchmarks")
import torch
from oomb import Engine, OOMBConfig
from oomb.engine.offload import OffloadedKVStore, min_gpu_pages
from bench_sparse import autotuned_configs, build
T, mib = int(os.environ["LEN"]), os.environ["STASH_MIB"]
m = build("qwen2.5-7b", torch.device("cuda"), torch.bfloat16); m.config.use_cache = False
cfg = OOMBConfig(chunk_size=4096, page_size=128, attention_backend="triton", offload=True, checkpoint_layers=True,
                 sparse=True, page_budget=64, sink_pages=1, local_pages=8, gpu_page_budget=min_gpu_pages(28, T // 128, None))
ids = torch.randint(0, m.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0)).cuda()
w = 20480  # warm-up: every kernel compiled and autotuned before the timed runs (the autotune keys leave out lengths)
import dataclasses; Engine(m, dataclasses.replace(cfg, gpu_page_budget=min_gpu_pages(28, w // 128, None))).step(ids[:, :w])
m.zero_grad(set_to_none=True); torch.cuda.empty_cache()
rows = []
for name, stash, partial in (("base", "0", False), ("stash", mib, False), ("partial_shadow", "0", True), ("base2", "0", False)):
    os.environ["OOMB_OFFLOAD_KV_STASH_MIB"] = stash
    OffloadedKVStore.stage1_shadow_partial = partial
    e = Engine(m, cfg); e.reserve(T); torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter(); out = e.step(ids); torch.cuda.synchronize(); dt = time.perf_counter() - t0
    st = e.kv_store
    row = dict(run=name, loss=repr(out.loss), seconds=round(dt, 2), stage1=round(out.stage1_seconds, 2),
               stage2=round(out.stage2_seconds, 2), stash_tiles=st.kv_stash_tiles, shadow_pages=st.stage1_shadow_pages,
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), **{k: v for k, v in st.stats.items()})
    print(json.dumps(row), flush=True); rows.append(row)
    m.zero_grad(set_to_none=True); del e, st; torch.cuda.empty_cache()
json.dump(dict(rows=rows, autotuned=autotuned_configs(), len=T), open(os.path.join(os.environ["R"], "stash_ab.json"), "w"), indent=1)
PY
el done
