"""Offload settings A/B in ONE process: the sparse step with every page offloaded, once per setting.

Every run shares the process's autotuned kernel configs, so the differences are the settings'. The step:
Qwen2.5-7B shape, bf16, ``--length`` tokens (default 262,144), chunk 4096, sparse attention (budget 64 + sink 1 +
local 8), per-layer checkpointing, the minimum GPU pool (whole-layer staging, no resident page), after a warm-up
step at 20K tokens that compiles and tunes every kernel. ``--set NAME`` picks the runs (each ~90 s at 256K):

- ``sets``: staging sets 2, 3, 3 with the K/V stash, 4 (``engine.offload.staging_sets``, ``kv_stash_mib``);
- ``stash``: no stash, the stash (``--stash-mib``; 16,384 holds every tile at 256K), no stash again (noise);
- ``copy``: the zero-copy copy kernel's shape (``engine.kernels.page_gather_programs`` / ``_warps`` / ``_elems``):
  the default, 32 x 4 x 8192, 16 x 8 x 16384, 4 x 32 x 16384, the default again;
- ``streams``: ``engine.offload.copy_streams`` 2 and 1.

One JSON line per run (loss, seconds per stage, the store's byte counters, peak GPU memory) and
``offload_ab_<set>.json`` under ``--out``. The losses of every run must be bitwise equal.

Usage: ``python benchmarks/offload_ab.py --set sets --out benchmarks/results`` (CUDA only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_sparse import autotuned_configs, build  # noqa: E402
from oomb import Engine, OOMBConfig  # noqa: E402
from oomb.config import KernelConfig, OffloadConfig, SparseConfig  # noqa: E402
from oomb.engine.offload import min_gpu_pages  # noqa: E402
from overrides import config_record  # noqa: E402


def runs(which: str, stash_mib: int) -> list[tuple[str, dict, dict]]:
    """(name, OffloadConfig fields, KernelConfig fields) of each run of the set ``which``."""
    return {
        "sets": [("sets2", {"staging_sets": 2}, {}), ("sets3", {"staging_sets": 3}, {}),
                 ("sets3_stash", {"staging_sets": 3, "kv_stash_mib": stash_mib}, {}), ("sets4", {"staging_sets": 4}, {})],
        "stash": [("base", {}, {}), ("stash", {"kv_stash_mib": stash_mib}, {}), ("base_again", {}, {})],
        "copy": [("default", {}, {})] + [
            (f"p{p}w{w}e{e}", {}, {"page_gather_programs": p, "page_gather_warps": w, "page_gather_elems": e})
            for p, w, e in ((32, 4, 8192), (16, 8, 16384), (4, 32, 16384))] + [("default_again", {}, {})],
        "streams": [("streams2", {"copy_streams": 2}, {}), ("streams1", {"copy_streams": 1}, {})],
    }[which]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", dest="which", default="sets", choices=["sets", "stash", "copy", "streams"])
    ap.add_argument("--length", type=int, default=262144)
    ap.add_argument("--stash-mib", type=int, default=16384)
    ap.add_argument("--warmup-len", type=int, default=20480)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    model = build("qwen2.5-7b", dev, torch.bfloat16)
    model.config.use_cache = False
    L, T = model.config.num_hidden_layers, args.length
    base = OOMBConfig(chunk_size=4096, page_size=128, attention_backend="triton", checkpoint_layers=True,
                      sparse=SparseConfig(page_budget=64, sink_pages=1, local_pages=8), offload=OffloadConfig(mode="on"))

    def with_pool(cfg: OOMBConfig, tokens: int) -> OOMBConfig:
        pool = min_gpu_pages(L, -(-tokens // 128), None, cfg.offload.staging_sets)  # staging only, nothing resident
        return dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, gpu_page_budget=pool))

    ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0)).to(dev)
    Engine(model, with_pool(base, args.warmup_len)).step(ids[:, : args.warmup_len])
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    rows = []
    for name, offload, kernels in runs(args.which, args.stash_mib):
        cfg = dataclasses.replace(base, offload=dataclasses.replace(base.offload, **offload),
                                  kernels=KernelConfig(**kernels))
        engine = Engine(model, with_pool(cfg, T))
        engine.reserve(T)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = engine.step(ids)
        torch.cuda.synchronize()
        store = engine.kv_store
        row = dict(run=name, config=config_record(engine.config), loss=repr(out.loss),
                   seconds=round(time.perf_counter() - t0, 2), stage1=round(out.stage1_seconds, 2),
                   stage2=round(out.stage2_seconds, 2), peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                   **dict(getattr(store, "stats", {})))
        print(json.dumps(row), flush=True)
        rows.append(row)
        model.zero_grad(set_to_none=True)
        del engine, store
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"offload_ab_{args.which}.json"), "w") as f:
        json.dump(dict(rows=rows, autotuned=autotuned_configs(), length=T, set=args.which), f, indent=1)


if __name__ == "__main__":
    main()
