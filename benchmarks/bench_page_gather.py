"""Zero-copy (page, KV head) gather/scatter between pinned host memory and the GPU pool.

Measures, on one GPU, for a Qwen2.5-7B layer's page shape (page 128, 4 KV heads, head dim 128):

* DMA reference: one ``copy_`` of a whole span, host->device and device->host (GB/s);
* :func:`oomb.ops.page_gather.gather_head_pages` / ``scatter_head_pages``: useful GB/s (bytes of the
  listed tiles) for bf16 (K/V) and fp32 (dK/dV) tiles, by tile density and persistent programs;
* interference: a bf16 GEMM loop on the compute stream alone, and with the gather looping on a side
  stream (both rates);
* correctness: each kernel's result against the PyTorch reference (bitwise).

The host span is allocated the way the offload store does it (pageable, then cudaHostRegister).

Usage: python benchmarks/bench_page_gather.py --out DIR [--pages 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from oomb.engine.offload import host_empty  # noqa: E402
from oomb.ops.page_gather import (  # noqa: E402
    gather_head_pages,
    gather_head_pages_ref,
    head_pairs,
    scatter_head_pages,
)


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--interference-only", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    S, H, D, m = 128, 4, 128, args.pages
    pins: list[int] = []
    rows = []
    keep = []  # registered host buffers stay alive until the end
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [m, S, H, D], "rows": rows}
    torch.ones(256, 256, device=dev) @ torch.ones(256, 256, device=dev)  # cuBLAS handle before any pinning
    order = (torch.bfloat16, torch.float32) if not args.interference_only else (torch.bfloat16,)
    for dtype in order:
        host = host_empty((m, S, H, D), dtype, True, pins)
        host.copy_(torch.randn(m, S, H, D, dtype=dtype))
        pool = torch.empty((m + 8, S, H, D), dtype=dtype, device=dev)
        # One write-back target per dtype, kept alive: a freed registered buffer whose address range is reused by
        # a later allocation would leave a stale registration (the kernel's writes would land elsewhere).
        back = host_empty((m, S, H, D), dtype, True, pins)
        span_bytes = host.numel() * host.element_size()
        t = timed(lambda: pool[8:].copy_(host, non_blocking=True))
        rows.append({"kind": "dma_h2d", "dtype": str(dtype), "GBps": span_bytes / t / 1e9})
        t = timed(lambda: host.copy_(pool[8:], non_blocking=True))
        rows.append({"kind": "dma_d2h", "dtype": str(dtype), "GBps": span_bytes / t / 1e9})
        print(rows[-2], rows[-1], flush=True)
        g = torch.Generator().manual_seed(0)
        for density in (0.25, 0.5, 1.0) if not args.interference_only else ():
            mask = (torch.rand(m, H, generator=g) < density).to(dev)
            valid = (torch.rand(m, H, generator=g) < 0.9).to(dev)
            pairs, count = head_pairs(mask)
            moved = int(count.item()) * S * D * host.element_size()
            # correctness against the reference (bitwise)
            pool.fill_(1.5)
            gather_head_pages(pool, 8, host, pairs, count, valid)
            ref = torch.full_like(pool, 1.5)
            gather_head_pages_ref(ref, 8, host, pairs, count, valid)
            ok_g = bool(torch.equal(pool, ref))
            back.fill_(-2.0)
            scatter_head_pages(back, pool, 8, pairs, count)
            torch.cuda.synchronize()
            exp = torch.full_like(back, -2.0)
            idx = pairs[: int(count.item())].long().cpu()
            exp[idx // H, :, idx % H] = ref[8 + idx // H, :, idx % H].cpu()
            ok_s = bool(torch.equal(back, exp))
            for nprog in (8, 16, 32, 64, 132):
                tg = timed(lambda: gather_head_pages(pool, 8, host, pairs, count, None, num_programs=nprog))
                ts = timed(lambda: scatter_head_pages(back, pool, 8, pairs, count, num_programs=nprog))
                row = {"kind": "tiles", "dtype": str(dtype), "density": density, "programs": nprog,
                       "gather_GBps": moved / tg / 1e9, "scatter_GBps": moved / ts / 1e9,
                       "gather_ms": tg * 1e3, "scatter_ms": ts * 1e3, "bitwise_gather": ok_g, "bitwise_scatter": ok_s}
                rows.append(row)
                print(row, flush=True)
        if dtype == torch.bfloat16:
            # interference with compute: GEMM loop alone, then with the gather looping on a side stream
            a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
            b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
            mask = (torch.rand(m, H, generator=g) < 0.5).to(dev)
            pairs, count = head_pairs(mask)
            moved = int(count.item()) * S * D * host.element_size()

            torch.cuda.synchronize()

            def gemms(n=40):
                for _ in range(n):
                    a @ b

            t_alone = timed(gemms, reps=2)
            side = torch.cuda.Stream()
            for nprog in (4, 8, 16, 32, 64):
                torch.cuda.synchronize()
                ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                evs0, evs1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev0.record()
                with torch.cuda.stream(side):
                    evs0.record(side)
                    for _ in range(12):
                        gather_head_pages(pool, 8, host, pairs, count, None, num_programs=nprog)
                    evs1.record(side)
                gemms()
                ev1.record()
                torch.cuda.synchronize()
                tg = evs0.elapsed_time(evs1) / 1e3
                tc = ev0.elapsed_time(ev1) / 1e3
                row = {"kind": "interference", "programs": nprog, "gemm_alone_s": t_alone, "gemm_with_gather_s": tc,
                       "gather_GBps_during": 12 * moved / tg / 1e9, "gather_s": tg}
                rows.append(row)
                print(row, flush=True)
            # the same GEMMs beside DMA copies of about the same bytes (copy engines, no SMs)
            torch.cuda.synchronize()
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            with torch.cuda.stream(side):
                for _ in range(6):
                    pool[8:].copy_(host, non_blocking=True)
            gemms()
            ev1.record()
            torch.cuda.synchronize()
            row = {"kind": "interference_dma", "gemm_alone_s": t_alone, "gemm_with_dma_s": ev0.elapsed_time(ev1) / 1e3}
            rows.append(row)
            print(row, flush=True)
        del pool
        keep.append((host, back))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "page_gather.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f} s")
