"""Offload overhead of the dense step in ONE process: every page on the GPU against pages offloaded, same tokens.

The Qwen2.5-7B shape (``--model``) in bf16, chunk 4096, ``--length`` tokens (default 131,072) of random ids, one
model for every run. Runs (``--runs``, in the order given):

* ``gpu``: offload off, attention backend ``sdpa`` -- cuDNN over the contiguous past: the default step;
* ``offload-sdpa``: offload on with ``--gpu-page-budget`` pages on the GPU (default 16,000 scaled to the length,
  56% of the pages), backend ``sdpa``: cuDNN over each staged segment's contiguous runs;
* ``offload-triton``: the same offload, backend ``triton``: the paged Triton kernels read every call.

Each run: one warm-up step on the same tokens (it compiles and tunes every kernel variant the timed steps use), then
``--steps`` timed steps (default 3). One JSON line per run to ``--out``: min / median / max seconds, the Stage-1 and
Stage-2 medians, the loss of each step, peak GPU memory, the store's copied bytes, and ``overhead`` = median over
the ``gpu`` run's median - 1. The losses of one run's steps must be equal (same weights: no optimizer).

Usage (CUDA): ``python benchmarks/offload_overhead.py --length 131072 --out offload_overhead.jsonl``;
CPU smoke test: ``--model tiny --device cpu --length 2048 --chunk-size 256 --page-size 64 --runs gpu offload-sdpa``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from oomb import Engine, OOMBConfig  # noqa: E402
from oomb.config import OffloadConfig  # noqa: E402
from oomb.engine.offload import OffloadedKVStore  # noqa: E402
from oomb.models.presets import build_model  # noqa: E402

GiB = 1 << 30
RUNS = {"gpu": ("off", "sdpa"), "offload-sdpa": ("on", "sdpa"), "offload-triton": ("on", "triton")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--length", type=int, default=131072, help="tokens per step")
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--gpu-page-budget", type=int, default=None,
                   help="GPU pages of the offloaded runs (default: 16,000 x length / 131,072)")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--steps", type=int, default=3, help="timed steps per run, after one warm-up step")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSON lines, appended")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    budget = a.gpu_page_budget or max(1, 16000 * a.length // 131072)
    torch.manual_seed(a.seed)
    model = build_model(a.model, dtype=torch.bfloat16 if cuda else torch.float32, device=dev)
    ids = torch.randint(0, model.config.vocab_size, (1, a.length), device=dev)
    meta = dict(kind="run", time=time.strftime("%Y-%m-%dT%H:%M:%S"), command=[sys.executable, *sys.argv],
                model=a.model, length=a.length, chunk_size=a.chunk_size, page_size=a.page_size, gpu_page_budget=budget,
                gpu=torch.cuda.get_device_name(dev) if cuda else "cpu", python=platform.python_version(),
                torch=torch.__version__, cudnn=torch.backends.cudnn.version() if cuda else None)
    rows = [meta]
    _write(a.out, meta)
    base = None
    for name in a.runs:
        mode, backend = RUNS[name]
        cfg = OOMBConfig(chunk_size=a.chunk_size, page_size=a.page_size, attention_backend=backend,
                         offload=OffloadConfig(mode=mode, gpu_page_budget=budget if mode == "on" else None))
        engine = Engine(model, cfg)
        steps = []
        for i in range(a.steps + 1):
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            out = engine.step(ids)
            if i:  # step 0 is the warm-up
                steps.append(out)
        sec = [o.seconds for o in steps]
        store = engine.kv_store
        row = dict(kind="result", system=name, offload=mode, attention_backend=backend,
                   seconds_min=min(sec), seconds_median=statistics.median(sec), seconds_max=max(sec), seconds=sec,
                   stage1_median=statistics.median(o.stage1_seconds for o in steps),
                   stage2_median=statistics.median(o.stage2_seconds for o in steps),
                   tokens_per_s=a.length / statistics.median(sec), loss=[o.loss for o in steps],
                   peak_gpu_gib=None if steps[-1].peak_memory_bytes is None else steps[-1].peak_memory_bytes / GiB,
                   kv_gpu_gib=store.nbytes / GiB, store=type(store).__name__)
        if isinstance(store, OffloadedKVStore):
            row.update(resident_pages_per_layer=store.resident_pages_per_layer, gpu_pages=store.gpu_pool_pages,
                       host_pinned_gib=store.host_nbytes / GiB, segmented=store.segmented,
                       h2d_gib_per_step=store.stats["h2d_bytes"] / GiB / (a.steps + 1),
                       d2h_gib_per_step=store.stats["d2h_bytes"] / GiB / (a.steps + 1),
                       on_demand_stagings=store.stats["on_demand"])
        if name == "gpu":
            base = row["seconds_median"]
        row["overhead"] = None if base is None else row["seconds_median"] / base - 1
        rows.append(row)
        _write(a.out, row)
        print(json.dumps(row), flush=True)
        del engine, store
        if cuda:
            torch.cuda.empty_cache()


def _write(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
