#!/usr/bin/env bash
# One device call (one H200): Stage-2 offload settings A/B in ONE process (every run shares the autotuned kernel
# configs), on the issue-5 shape with every page offloaded: Qwen2.5-7B shape, bf16, LEN (default 262144) tokens,
# chunk 4096, budget 64+1+8, per-layer checkpointing, the minimum GPU pool (two layers of staging, nothing
# resident), after a 20K warm-up. SET picks the runs (each ~90 s at 256K; 4-5 fit in one call):
#   SET=stash (default): base; K/V stash (STASH_MIB, default 16384: every tile of every layer at 256K); partial
#     Stage-1 shadow; base again (noise, and bitwise-equal losses).
#   SET=warps: the zero-copy copy kernel's shape (OOMB_PAGE_GATHER_PROGRAMS / _WARPS / _ELEMS): 32 x 4 warps x 8192
#     (the default), 8 x 16 x 16384, 16 x 8 x 16384, 4 x 32 x 16384, then the default again.
#   SET=mixed: base; stash; 8 x 16 x 16384; stash with 8 x 16 x 16384; partial shadow.
#   SET=sets: whole-layer staging sets (OOMB_OFFLOAD_STAGING_SETS) 2, 3, 3 with the stash, 4. Prediction (before the
#     run): the 256K min-pool A/B showed the stash cut host->device bytes 17% but Stage 2 only 1 s, so the wait is not
#     the bytes but the chain write-back(l+2) -> dK/dV gather(l) within one layer's backward; 3 sets give it two
#     layers: Stage 2 -5..-10 s if that chain is the cause.
# Predictions (eleventh session, before any run): stash: host->device bytes -24%, Stage 2 a few seconds faster (its
# offload overhead at 256K min pool is ~24 s, half of it waiting on copies); losses bitwise equal in every run.
# warps: the same bytes in flight on 8 or 4 SMs instead of 32 should leave the attention kernels beside the copies
# most of the 28% they lose now; if the copies keep ~45 GB/s, Stage 2 -5..-10 s. Losses bitwise equal.
set -u
. benchmarks/gpu_common.sh
gpu_env
el "Stage-2 A/B (${SET:-stash}), ${LEN:-262144} tokens, min pool"
R="$R" SET=${SET:-stash} LEN=${LEN:-262144} STASH_MIB=${STASH_MIB:-16384} timeout ${T_AB:-560} python3 - <<'PY' 2>&1 | grep -Ev "$F" | tee "$R/ab_${SET:-stash}.txt"
import dataclasses, json, os, sys, time; sys.argv = ["x"]; sys.path.insert(0, "benchmarks")
import torch
from oomb import Engine, OOMBConfig
from oomb.engine.offload import OffloadedKVStore, min_gpu_pages
from bench_sparse import autotuned_configs, build
T, mib, which = int(os.environ["LEN"]), os.environ["STASH_MIB"], os.environ["SET"]
KNOBS = ("OOMB_OFFLOAD_KV_STASH_MIB", "OOMB_PAGE_GATHER_PROGRAMS", "OOMB_PAGE_GATHER_WARPS", "OOMB_PAGE_GATHER_ELEMS",
         "OOMB_OFFLOAD_STAGING_SETS")
RUNS = {
    "stash": [("base", {}, False), ("stash", {"OOMB_OFFLOAD_KV_STASH_MIB": mib}, False), ("partial_shadow", {}, True),
              ("base2", {}, False)],
    "warps": [("p32w4e8192", {}, False)] + [
        (f"p{p}w{w}e{e}", {"OOMB_PAGE_GATHER_PROGRAMS": str(p), "OOMB_PAGE_GATHER_WARPS": str(w), "OOMB_PAGE_GATHER_ELEMS": str(e)}, False)
        for p, w, e in ((8, 16, 16384), (16, 8, 16384), (4, 32, 16384))] + [("p32w4e8192_again", {}, False)],
    "mixed": [("base", {}, False), ("stash", {"OOMB_OFFLOAD_KV_STASH_MIB": mib}, False),
              ("p8w16e16384", {"OOMB_PAGE_GATHER_PROGRAMS": "8", "OOMB_PAGE_GATHER_WARPS": "16", "OOMB_PAGE_GATHER_ELEMS": "16384"}, False),
              ("stash_p8w16e16384", {"OOMB_OFFLOAD_KV_STASH_MIB": mib, "OOMB_PAGE_GATHER_PROGRAMS": "8",
                                     "OOMB_PAGE_GATHER_WARPS": "16", "OOMB_PAGE_GATHER_ELEMS": "16384"}, False),
              ("partial_shadow", {}, True)],
    "sets": [("sets2", {}, False), ("sets3", {"OOMB_OFFLOAD_STAGING_SETS": "3"}, False),
             ("sets3_stash", {"OOMB_OFFLOAD_STAGING_SETS": "3", "OOMB_OFFLOAD_KV_STASH_MIB": mib}, False),
             ("sets4", {"OOMB_OFFLOAD_STAGING_SETS": "4"}, False)],
    "sets3": [("sets3", {"OOMB_OFFLOAD_STAGING_SETS": "3"}, False)],
}[which]
m = build("qwen2.5-7b", torch.device("cuda"), torch.bfloat16); m.config.use_cache = False
cfg = OOMBConfig(chunk_size=4096, page_size=128, attention_backend="triton", offload=True, checkpoint_layers=True,
                 sparse=True, page_budget=64, sink_pages=1, local_pages=8, gpu_page_budget=min_gpu_pages(28, T // 128, None))
ids = torch.randint(0, m.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0)).cuda()
w = 20480  # warm-up: every kernel compiled and autotuned before the timed runs (the autotune keys leave out lengths)
Engine(m, dataclasses.replace(cfg, gpu_page_budget=min_gpu_pages(28, w // 128, None))).step(ids[:, :w])
m.zero_grad(set_to_none=True); torch.cuda.empty_cache()
rows = []
for name, env, partial in RUNS:
    for k in KNOBS:
        os.environ.pop(k, None)
    os.environ.update(env)
    OffloadedKVStore.stage1_shadow_partial = partial
    # the minimum pool for this run's settings (more staging sets need more)
    e = Engine(m, dataclasses.replace(cfg, gpu_page_budget=min_gpu_pages(28, T // 128, None))); e.reserve(T); torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter(); out = e.step(ids); torch.cuda.synchronize(); dt = time.perf_counter() - t0
    st = e.kv_store
    row = dict(run=name, env=env, loss=repr(out.loss), seconds=round(dt, 2), stage1=round(out.stage1_seconds, 2),
               stage2=round(out.stage2_seconds, 2), stash_tiles=st.kv_stash_tiles, shadow_pages=st.stage1_shadow_pages,
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), **{k: v for k, v in st.stats.items()})
    print(json.dumps(row), flush=True); rows.append(row)
    m.zero_grad(set_to_none=True); del e, st; torch.cuda.empty_cache()
json.dump(dict(rows=rows, autotuned=autotuned_configs(), len=T, set=which),
          open(os.path.join(os.environ["R"], f"ab_{which}.json"), "w"), indent=1)
PY
el done
