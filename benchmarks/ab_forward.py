"""A/B of the paged-attention forward kernel against another version of the kernel module, in ONE process.

Tells whether a kernel change moved the forward's speed, with the autotuner, the inputs and the GPU the same for
both. This script loads the other module from a file (for example
``git show REV:oomb/ops/triton_paged_attention.py > /tmp/old.py``), runs both forwards on the
same inputs (Qwen2.5-7B attention shape: 28 query heads, 4 KV heads, head dim 128, bf16, page 128,
shuffled block table), checks that the outputs agree, and times them alternately.

Usage::

    PYTHONPATH=. python benchmarks/ab_forward.py --old /tmp/old.py --past 32768 131072 --out results/
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from oomb.ops.triton import paged_attention as new_mod  # noqa: E402


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _time(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="path of the older triton_paged_attention.py")
    ap.add_argument("--past", type=int, nargs="+", default=[32768, 131072], help="past tokens")
    ap.add_argument("--chunk", type=int, default=4096, help="queries")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="folder for ab_forward.json")
    args = ap.parse_args()
    old_mod = _load(args.old, "oomb_old_triton_paged_attention")
    torch.manual_seed(0)
    Hq, Hkv, D, S, C = 28, 4, 128, 128, args.chunk
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for past in args.past:
        n_pages = math.ceil(past / S)
        k_cache = torch.randn(n_pages, S, Hkv, D, device=dev, dtype=dt)
        v_cache = torch.randn(n_pages, S, Hkv, D, device=dev, dtype=dt)
        bt = torch.randperm(n_pages, device=dev).to(torch.int32)
        q = torch.randn(C, Hq, D, device=dev, dtype=dt)
        k = torch.randn(C, Hkv, D, device=dev, dtype=dt)
        v = torch.randn(C, Hkv, D, device=dev, dtype=dt)
        call = {
            "old": lambda: old_mod.paged_attention_fwd(q, k, v, k_cache, v_cache, bt, past),
            "new": lambda: new_mod.paged_attention_fwd(q, k, v, k_cache, v_cache, bt, past),
        }
        outs = {name: f() for name, f in call.items()}  # compiles + autotunes each
        torch.cuda.synchronize()
        same_out = torch.equal(outs["old"][0], outs["new"][0]) and torch.equal(outs["old"][1], outs["new"][1])
        max_diff = (outs["old"][0].float() - outs["new"][0].float()).abs().max().item()
        times = {"old": [], "new": []}
        for _ in range(3):  # alternate to spread clock drift over both
            for name, f in call.items():
                times[name] += _time(f, args.reps)
        flops = 4 * Hq * D * (C * past + C * C / 2)
        row = {"past": past, "bitwise_equal": same_out, "max_abs_diff": max_diff}
        for name in ("old", "new"):
            ms = statistics.median(times[name])
            row[f"{name}_ms"] = round(ms, 3)
            row[f"{name}_tflops"] = round(flops / ms / 1e9, 1)
        row["new_over_old_speed"] = round(row["old_ms"] / row["new_ms"], 3)
        for name, mod in (("old", old_mod), ("new", new_mod)):
            cache = getattr(mod._paged_attn_fwd_kernel, "cache", {})
            row[f"{name}_config"] = [str(c) for c in cache.values()]
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "old": args.old,
                "shape": {"Hq": Hq, "Hkv": Hkv, "D": D, "page_size": S, "chunk": C, "dtype": "bfloat16"}}
        (Path(args.out) / "ab_forward.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
