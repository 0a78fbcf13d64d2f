"""Where the GPU time of one sparse training step goes: one step under torch.profiler, kernels grouped by kind.

After an untimed warm-up step at the same length (compilation and autotuning), one sparse step (forward +
backward, no optimizer; Qwen2.5-7B shape by default, random tokens) runs under ``torch.profiler``. Writes
``<out>/profile_sparse_<model>_<T><tag>.txt`` (the top kernels by GPU time) and ``.json`` (GPU seconds per
group: sparse attention forward / dq / dK-dV, the own chunk's attention, page selection, matrix products,
the rest, with wall time and the step time without the profiler).

    python benchmarks/profile_sparse_step.py --length 65536 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from bench_sparse import build, engine_config  # noqa: E402
from overrides import add_set_argument  # noqa: E402

from oomb import Engine  # noqa: E402

GROUPS = (  # (group, substrings of a kernel name), first match wins
    ("sparse_fwd", ("_sparse_attn_fwd",)),
    ("sparse_dq", ("_sparse_attn_bwd_dq",)),
    ("sparse_dkdv", ("_sparse_attn_bwd_dkdv",)),
    ("own_chunk_attention", ("cudnn", "flash", "fmha", "_paged_", "_attn_fwd", "_attn_bwd")),
    ("selection_and_sorts", ("select", "topk", "sort", "radix", "_score")),  # sorts: also the dK/dV CSR map
    ("matmul", ("nvjet", "gemm", "cutlass", "sm90_xmma", "cublas")),
)


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k.lower() in low for k in keys):
            return group
    return "other"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--length", type=int, default=65536)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--page-budget", type=int, default=64)
    ap.add_argument("--sink-pages", type=int, default=1)
    ap.add_argument("--local-pages", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--score", default="mean", choices=["mean", "quest"])
    ap.add_argument("--offload", default="off", choices=["auto", "on", "off"])
    ap.add_argument("--checkpoint-layers", action="store_true")
    ap.add_argument("--gpu-page-budget", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    add_set_argument(ap)
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    model = build(args.model, device, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)

    def one_step() -> float:
        ids = torch.randint(0, 32000, (1, args.length), generator=gen).to(device)
        engine = Engine(model, engine_config(args, True, "triton"))
        engine.reserve(args.length)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step(ids)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        del engine
        torch.cuda.empty_cache()
        return dt

    warm = one_step()
    plain = one_step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        one_step()
        wall = time.perf_counter() - t0
    groups: dict[str, float] = {}
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if us <= 0 or e.key.startswith("aten::") or e.key.startswith("cuda"):
            continue
        kernels.append((us, e.count, e.key))
        groups[group_of(e.key)] = groups.get(group_of(e.key), 0.0) + us / 1e6
    kernels.sort(reverse=True)
    total = sum(groups.values())
    stem = os.path.join(args.out, f"profile_sparse_{args.model}_{args.length}{args.tag}")
    os.makedirs(args.out, exist_ok=True)
    lines = [f"# sparse step, {args.model}, {args.length} tokens, chunk {args.chunk_size}, budget {args.page_budget}"
             f"{(', ' + ', '.join(args.sets)) if args.sets else ''}: "
             f"step {plain:.2f} s without the profiler ({warm:.2f} s warm-up), {wall:.2f} s with it; "
             f"GPU kernel time {total:.2f} s", "", "| group | GPU s | share |", "|---|---:|---:|"]
    for g, s in sorted(groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {g} | {s:.2f} | {s / total:.1%} |")
    lines += ["", "| GPU ms | calls | ms/call | group | kernel |", "|---:|---:|---:|---|---|"]
    for us, n, key in kernels[:40]:
        lines.append(f"| {us / 1e3:.1f} | {n} | {us / 1e3 / n:.3f} | {group_of(key)} | {key[:110]} |")
    text = "\n".join(lines) + "\n"
    with open(stem + ".txt", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump(dict(length=args.length, step_s=plain, warmup_s=warm, profiled_wall_s=wall, gpu_s=groups,
                       gpu=torch.cuda.get_device_name(), torch=torch.__version__, config=vars(args)), f, indent=2)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
