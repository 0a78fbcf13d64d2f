"""Host<->device copy bandwidth: each direction alone, both on one stream, both on two streams.

The premise of offload's two copy streams (oomb/engine/offload.py, "Ordering"): PCIe is full duplex, so
a device->host write-back on its own stream can run at the same time as a host->device staging, where one
stream runs them one after the other. This measures it with pinned host memory (what the store uses).

Usage::

    python benchmarks/bench_copy_duplex.py --gib 2 --out results/
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="bytes per direction per copy, GiB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="folder for copy_duplex.json")
    args = ap.parse_args()
    n = int(args.gib * (1 << 30))
    h_src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    h_dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d_dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    d_src = torch.empty(n, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def h2d(s):
        with torch.cuda.stream(s):
            d_dst.copy_(h_src, non_blocking=True)

    def d2h(s):
        with torch.cuda.stream(s):
            h_dst.copy_(d_src, non_blocking=True)

    cases = {
        "h2d alone": lambda: h2d(s1),
        "d2h alone": lambda: d2h(s1),
        "both, one stream": lambda: (h2d(s1), d2h(s1)),
        "both, two streams": lambda: (h2d(s1), d2h(s2)),
    }
    rows = []
    for name, fn in cases.items():
        times = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            s1.wait_event(a)
            s2.wait_event(a)
            fn()
            torch.cuda.current_stream().wait_stream(s1)
            torch.cuda.current_stream().wait_stream(s2)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        t = sorted(times)[len(times) // 2]
        moved = n * (2 if name.startswith("both") else 1)
        rows.append({"case": name, "seconds": round(t, 4), "gb_per_s_total": round(moved / t / 1e9, 1)})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "bytes_per_direction": n}
        (Path(args.out) / "copy_duplex.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
