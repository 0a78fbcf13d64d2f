"""Where Stage-2 time goes with sparse + offload: a CUDA timeline of a few Stage-2 chunks.

One step of the Qwen2.5-7B-shaped model (random weights, bf16, sparse, offload on, ``--checkpoint-layers``)
with ``torch.profiler`` active over ``--active`` Stage-2 chunks after ``--skip`` of them, then a summary
of the kernel timeline: per stream, busy time (union of kernel intervals); how much of the compute
stream's busy time overlaps a copy kernel (the zero-copy tile gather/scatter of
:mod:`oomb.ops.page_gather`) or a DMA copy; the compute stream's idle gaps; and, per compute kernel, its
mean duration with and without a copy kernel running beside it (the interference of SM-driven copies).
Writes ``profile_stage2<tag>.json`` (the summary) to ``--out``.

    python3 benchmarks/profile_offload_stage2.py --length 262144 --min-pool --out $OUT

Needs a CUDA GPU (the timeline comes from CUPTI).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from oomb import Engine, OOMBConfig  # noqa: E402
from oomb.engine import engine as engine_mod  # noqa: E402
from oomb.memory import min_gpu_pages  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sparse import autotuned_configs, build  # noqa: E402
from oomb.config import OffloadConfig, SparseConfig  # noqa: E402
from overrides import add_set_argument, apply_sets, config_record  # noqa: E402

COPY_KERNEL = "_copy_tiles_kernel"


def union(intervals):
    """Sorted, merged [(start, end)] of ``intervals``."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def total(iv):
    return sum(b - a for a, b in iv)


def intersect(x, y):
    """Length of the intersection of two merged interval lists."""
    i = j = 0
    s = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            s += b - a
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return s


def overlaps(iv, a, b):
    """Length of [a, b) covered by the merged intervals ``iv``."""
    import bisect

    k = max(0, bisect.bisect_left(iv, [a, a]) - 1)
    s = 0.0
    while k < len(iv) and iv[k][0] < b:
        s += max(0.0, min(b, iv[k][1]) - max(a, iv[k][0]))
        k += 1
    return s


def summarize(trace: dict) -> dict:
    """The timeline summary of a chrome trace (µs)."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_stream = collections.defaultdict(list)
    for e in ev:
        by_stream[e["args"].get("stream", -1)].append(e)
    # Compute stream: the one with the most kernel time that is not a copy kernel.
    def compute_time(es):
        return sum(e["dur"] for e in es if e["cat"] == "kernel" and COPY_KERNEL not in e["name"])
    compute = max(by_stream, key=lambda s: compute_time(by_stream[s]))
    t0 = min(e["ts"] for e in ev)
    t1 = max(e["ts"] + e["dur"] for e in ev)
    streams = {}
    for s, es in by_stream.items():
        iv = union([(e["ts"], e["ts"] + e["dur"]) for e in es])
        names = collections.Counter()
        for e in es:
            names[e["name"][:60]] += e["dur"]
        streams[str(s)] = dict(busy_ms=total(iv) / 1e3, events=len(es), top=[(n, round(d / 1e3, 2)) for n, d in names.most_common(6)])
    comp_iv = union([(e["ts"], e["ts"] + e["dur"]) for e in by_stream[compute]])
    copy_k = union([(e["ts"], e["ts"] + e["dur"]) for s, es in by_stream.items() if s != compute for e in es
                    if e["cat"] == "kernel"])
    dma = union([(e["ts"], e["ts"] + e["dur"]) for s, es in by_stream.items() if s != compute for e in es
                 if e["cat"] == "gpu_memcpy"])
    per_kernel = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])  # n alone, dur alone, n beside, dur beside
    for e in by_stream[compute]:
        if e["cat"] != "kernel":
            continue
        a, b = e["ts"], e["ts"] + e["dur"]
        beside = overlaps(copy_k, a, b) > 0.5 * e["dur"]
        r = per_kernel[e["name"][:60]]
        if beside:
            r[2] += 1
            r[3] += e["dur"]
        else:
            r[0] += 1
            r[1] += e["dur"]
    kern = sorted(per_kernel.items(), key=lambda kv: -(kv[1][1] + kv[1][3]))[:15]
    gaps = []
    for (a0, b0), (a1, b1) in zip(comp_iv, comp_iv[1:]):
        gaps.append(a1 - b0)
    big = [g for g in gaps if g > 50]
    return dict(
        window_ms=(t1 - t0) / 1e3, compute_stream=compute,
        compute_busy_ms=total(comp_iv) / 1e3, compute_idle_ms=(t1 - t0 - total(comp_iv)) / 1e3,
        compute_gaps_over_50us=dict(n=len(big), ms=sum(big) / 1e3),
        copy_kernel_busy_ms=total(copy_k) / 1e3, dma_busy_ms=total(dma) / 1e3,
        compute_beside_copy_kernel_ms=intersect(comp_iv, copy_k) / 1e3,
        compute_beside_dma_ms=intersect(comp_iv, dma) / 1e3,
        copy_kernel_while_compute_idle_ms=(total(copy_k) - intersect(comp_iv, copy_k)) / 1e3,
        streams=streams,
        compute_kernels=[dict(name=n, alone_n=r[0], alone_mean_us=round(r[1] / max(r[0], 1), 1), beside_n=r[2],
                              beside_mean_us=round(r[3] / max(r[2], 1), 1)) for n, r in kern],
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--length", type=int, default=262144)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--page-budget", type=int, default=64)
    ap.add_argument("--min-pool", action="store_true", help="the smallest GPU pool (every page offloaded)")
    ap.add_argument("--gpu-page-budget", type=int, default=None)
    ap.add_argument("--skip", type=int, default=4, help="Stage-2 chunks before the profiled ones")
    ap.add_argument("--active", type=int, default=2, help="Stage-2 chunks profiled")
    ap.add_argument("--warmup-len", type=int, default=16384)
    ap.add_argument("--no-profile", action="store_true", help="only time the step")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--keep-trace", action="store_true", help="also write the chrome trace (gzip)")
    add_set_argument(ap)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    model = build(args.model, dev, torch.bfloat16)
    model.config.use_cache = False
    L = model.config.num_hidden_layers
    budget = args.gpu_page_budget
    if args.min_pool:
        budget = min_gpu_pages(L, -(-args.length // 128), None)
    cfg = OOMBConfig(chunk_size=args.chunk_size, page_size=128, attention_backend="triton", checkpoint_layers=True,
                     sparse=SparseConfig(page_budget=args.page_budget, sink_pages=1, local_pages=8),
                     offload=OffloadConfig(mode="on", gpu_page_budget=budget))
    cfg = apply_sets(cfg, args.sets)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    warm = Engine(model, cfg)
    warm.step(torch.randint(0, vocab, (1, args.warmup_len), generator=g).to(dev))
    del warm
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    ids = torch.randint(0, vocab, (1, args.length), generator=g).to(dev)
    engine = Engine(model, cfg)
    engine.reserve(args.length)
    torch.cuda.synchronize()
    N = -(-args.length // args.chunk_size)
    prof = None
    if not args.no_profile:
        from torch.profiler import ProfilerActivity, profile, schedule

        # One profiler step per chunk: Stage 1 runs N-1 chunks, then Stage 2 from the last.
        sched = schedule(wait=N - 1 + args.skip, warmup=1, active=args.active, repeat=1)
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=sched)
        orig = engine_mod.Engine._run_chunk

        def run_chunk(self, input_ids, positions, ctx):
            prof.step()
            return orig(self, input_ids, positions, ctx)

        engine_mod.Engine._run_chunk = run_chunk
        prof.__enter__()
    t = time.perf_counter()
    out = engine.step(ids)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    row = dict(length=args.length, gpu_page_budget=budget, resident_pages_per_layer=engine.kv_store.resident_pages_per_layer,
               seconds=dt, stage1_seconds=out.stage1_seconds, stage2_seconds=out.stage2_seconds, loss=out.loss,
               programs=engine.kv_store.gather_programs, grain=engine.kv_store.stage_grain,
               config=config_record(cfg),
               stats={k: v for k, v in engine.kv_store.stats.items()}, profiled=not args.no_profile,
               autotuned=autotuned_configs())
    os.makedirs(args.out, exist_ok=True)
    if prof is not None:
        prof.__exit__(None, None, None)
        path = os.path.join(args.out, f"trace_stage2{args.tag}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        row["timeline"] = summarize(trace)
        row["timeline"]["chunks"] = args.active
        if args.keep_trace:
            with gzip.open(path + ".gz", "wt") as f:
                json.dump(trace, f)
        os.remove(path)
    print(json.dumps(row, indent=1, default=str))
    with open(os.path.join(args.out, f"profile_stage2{args.tag}.json"), "w") as f:
        json.dump(row, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
