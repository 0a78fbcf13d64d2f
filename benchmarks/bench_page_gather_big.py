"""Zero-copy tile gather/scatter over a LARGE pinned host tier: rate by position in the buffer
(NUMA placement), by program count, and gather + scatter at once (full duplex), next to DMA copies.

The 1M sparse step pins ~80 GiB of host memory; bench_page_gather.py measured 512 MiB. This one pins
``--host-gib`` GiB the way the offload store does (pageable + cudaHostRegister) and copies 1 GiB windows
at 0%, 25%, 50%, 75% and ~100% of it.

Usage: python benchmarks/bench_page_gather_big.py --out DIR [--host-gib 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oomb.engine.offload import host_empty  # noqa: E402
from oomb.ops.page_gather import gather_head_pages, head_pairs, scatter_head_pages  # noqa: E402
from bench_page_gather import timed  # noqa: E402  (same folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--host-gib", type=float, default=64)
    args = ap.parse_args()
    dev = torch.device("cuda")
    S, H, D = 128, 4, 128
    page_bytes = S * H * D * 2
    n = int(args.host_gib * 2**30 // page_bytes)
    pins: list[int] = []
    t0 = time.time()
    host = host_empty((n, S, H, D), torch.bfloat16, True, pins)
    pin_s = time.time() - t0
    host.view(torch.int16)[:: max(1, n // 64)].fill_(1)
    w = 2**30 // page_bytes  # pages of a 1 GiB window
    pool = torch.zeros((w + 8, S, H, D), dtype=torch.bfloat16, device=dev)
    mask = (torch.rand(w, H, generator=torch.Generator().manual_seed(0)) < 0.3).to(dev)
    pairs, count = head_pairs(mask)
    moved = int(count.item()) * S * D * 2
    rows = []
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host_gib": args.host_gib, "pin_s": pin_s,
           "window_pages": w, "density": 0.3, "rows": rows}
    side = torch.cuda.Stream()
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        lo = min(n - w, int(frac * n))
        span = host[lo : lo + w]
        row = {"window_at": frac}
        row["dma_h2d_GBps"] = w * page_bytes / timed(lambda: pool[8:].copy_(span, non_blocking=True)) / 1e9
        for nprog in (32, 128):
            row[f"gather_{nprog}_GBps"] = moved / timed(lambda: gather_head_pages(pool, 8, span, pairs, count, num_programs=nprog)) / 1e9
            row[f"scatter_{nprog}_GBps"] = moved / timed(lambda: scatter_head_pages(span, pool, 8, pairs, count, num_programs=nprog)) / 1e9

        def duplex():
            with torch.cuda.stream(side):
                scatter_head_pages(span, pool, 8, pairs, count)
            gather_head_pages(pool, 8, host[n - w - lo if lo else n - w : (n - w - lo if lo else n - w) + w], pairs, count)
            torch.cuda.current_stream().wait_stream(side)

        row["duplex_total_GBps"] = 2 * moved / timed(duplex) / 1e9
        rows.append(row)
        print(row, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "page_gather_big.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"pinned {args.host_gib} GiB in {pin_s:.1f} s")


if __name__ == "__main__":
    main()
