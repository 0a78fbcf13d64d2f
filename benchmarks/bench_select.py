"""Time select_pages (two sorts over the past) against ``_select_pages_topk`` (one topk) and, on CUDA,
``select_pages_triton`` (one kernel after the scores; what the engine uses with the Triton attention) on one device.

Per number of past pages n: milliseconds per call of each (median of --reps timed calls after
--warmup; the minimum too, in the JSON), the speedups over select_pages, and whether each PageSelection is
bitwise equal to select_pages'. Shape defaults to the 1M-token Qwen2.5-7B run: chunk 4096 (nb = 32 blocks of
128), Hq 28, Hkv 4, D 128, page budget 64, sink 1, local 8. On CUDA calls are timed with CUDA events; on CPU with perf_counter.

    PYTHONPATH=. python benchmarks/bench_select.py --out benchmarks/results/select.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from oomb.ops.sparse_select import _select_pages_topk, select_pages  # noqa: E402


def _triton_select():
    """select_pages_triton, or None where Triton does not import."""
    try:
        from oomb.ops.triton.page_select import select_pages_triton
    except ImportError:
        return None
    return select_pages_triton


def _same(a, b) -> bool:
    return bool(torch.equal(a.page_idx, b.page_idx) and torch.equal(a.counts, b.counts) and a.dense == b.dense)


def time_ms(fn, warmup: int, reps: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--hq", type=int, default=28)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--page-budget", type=int, default=64)
    ap.add_argument("--sink-pages", type=int, default=1)
    ap.add_argument("--local-pages", type=int, default=8)
    ap.add_argument("--score", default="mean", choices=["mean", "quest"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="representatives' dtype")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--block-n", type=int, default=None, help="select_pages_triton's pages per tile (default: its own)")
    ap.add_argument("--num-warps", type=int, default=4, help="select_pages_triton's warps per program")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cuda = device.type == "cuda"
    triton_select = _triton_select() if cuda else None  # the interpreter (CPU) is far too slow to time
    tri_opts = {"block_n": args.block_n, "num_warps": args.num_warps}
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(args.chunk, args.hq, args.head_dim, generator=gen, device=device, dtype=torch.bfloat16 if cuda else dtype)
    rows = []
    print(f"device {torch.cuda.get_device_name(device) if cuda else 'cpu'}, nb {-(-args.chunk // args.block_size)}, "
          f"Hq {args.hq}, Hkv {args.hkv}, D {args.head_dim}, budget {args.page_budget}, {args.score}, {args.dtype}")
    print(f"{'n pages':>8} {'sort ms':>9} {'topk ms':>9} {'speedup':>8} {'equal':>6} {'triton ms':>10} {'speedup':>8} "
          f"{'equal':>6}")
    for n in args.pages:
        reps = tuple(torch.randn(n, args.hkv, args.head_dim, generator=gen, device=device, dtype=dtype)
                     for _ in range(1 if args.score == "mean" else 2))
        if args.score == "quest":
            reps = (torch.minimum(*reps), torch.maximum(*reps))
        call = (q, reps, n * args.page_size, args.page_size, args.page_budget, args.sink_pages, args.local_pages,
                args.block_size, args.score)
        with torch.no_grad():
            a = select_pages(*call)
            equal = _same(a, _select_pages_topk(*call))
            (t_sort, min_sort), (t_topk, min_topk) = (time_ms(lambda f=f: f(*call), args.warmup, args.reps, cuda)
                                                      for f in (select_pages, _select_pages_topk))
            row = {"n_pages": n, "sort_ms": t_sort, "topk_ms": t_topk, "speedup": t_sort / t_topk, "equal": equal,
                   "sort_min_ms": min_sort, "topk_min_ms": min_topk}
            line = f"{n:>8} {t_sort:>9.3f} {t_topk:>9.3f} {t_sort / t_topk:>7.2f}x {str(equal):>6}"
            if triton_select is not None and args.dtype != "float64":
                # Bitwise against select_pages on the same inputs (both use the same PyTorch scores), and with
                # packed documents (a block-wise q_doc_start).
                doc = (torch.arange(args.chunk, device=device) // 1000 * 1000 + (n * args.page_size) // 3)
                t_equal = _same(triton_select(*call, **tri_opts), a) and _same(
                    triton_select(*call, q_doc_start=doc, **tri_opts), select_pages(*call, q_doc_start=doc))
                t_tri, min_tri = time_ms(lambda: triton_select(*call, **tri_opts), args.warmup, args.reps, cuda)
                row.update({"triton_ms": t_tri, "triton_min_ms": min_tri, "triton_speedup": t_sort / t_tri,
                            "triton_equal": t_equal})
                line += f" {t_tri:>10.3f} {t_sort / t_tri:>7.2f}x {str(t_equal):>6}"
        rows.append(row)
        print(line)
    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "threads": torch.get_num_threads(), "args": vars(args), "rows": rows}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
