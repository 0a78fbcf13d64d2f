"""The Triton sparse attention kernels against a baseline copy of them, in ONE process on the same inputs.

``--baseline DIR`` holds another version of ``oomb/ops/triton/sparse_attention.py`` and
``sparse_kernels.py`` (e.g. ``git show REV:oomb/ops/triton/sparse_kernels.py``); they are loaded beside the
package as ``oomb.ops.triton._baseline_*`` (their relative imports resolve to today's package; the launcher's
``.sparse_kernels`` import is pointed at the baseline kernels). Without it only today's kernels run.

Per variant (baseline; today's; today's with tensor descriptors off, ``KernelConfig(fwd_tma=False,
bwd_tma=False, dkdv_tma=False)``): forward and backward milliseconds over ``--reps`` timed calls after a
warm-up that autotunes every kernel (min / median / max, CUDA events), TFLOP/s on the attended tokens
(FlashAttention's count: 4 C Hq D per attended key forward, 2.5x that backward), and the relative error of
out, lse, dq, dk, dv and the gradient pages against the float64 reference (the same selection), next to the
reference's own error on the bf16 inputs.

    PYTHONPATH=. python benchmarks/sparse_kernels_ab.py --baseline /tmp/base --out /tmp/ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile

import torch

from oomb.config.engine import KernelConfig
from oomb.ops.sparse_attention_ref import sparse_attention_bwd_ref, sparse_attention_fwd_ref
from oomb.ops.sparse_representatives import page_representatives
from oomb.ops.sparse_select import PageSelection, select_pages
from oomb.ops.triton import sparse_attention as today


def load_baseline(folder: str):
    """The launcher module of the baseline copy in ``folder``, loaded as ``oomb.ops.triton._baseline_sparse_attention``."""
    tmp = tempfile.mkdtemp(prefix="oomb_ab_")
    mods = {}
    for name in ("sparse_kernels", "sparse_attention"):
        with open(os.path.join(folder, f"{name}.py")) as f:
            text = f.read().replace("from .sparse_kernels import", "from ._baseline_sparse_kernels import")
        path = os.path.join(tmp, f"_baseline_{name}.py")  # triton reads kernel source from the file
        with open(path, "w") as f:
            f.write(text)
        full = f"oomb.ops.triton._baseline_{name}"
        spec = importlib.util.spec_from_file_location(full, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[full] = mod
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods["sparse_attention"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return out


def spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    return dict(min=round(xs[0], 4), median=round(xs[len(xs) // 2], 4), max=round(xs[-1], 4))


def autotuned(launcher, autotune: str) -> dict:
    """The config the autotuner chose per key for each kernel of ``launcher``'s kernel module."""
    name = launcher.__name__.rsplit(".", 1)[0] + (".sparse_kernels" if launcher is today else "._baseline_sparse_kernels")
    mod = sys.modules[name]
    out = {}
    for kname, obj in vars(mod).items():
        if kname.endswith("_kernel") and hasattr(obj, "configs"):
            cache = getattr(obj[autotune], "cache", None) or {}
            out[kname] = {str(k): str(v) for k, v in cache.items()}
    return out


def kernel_ms(fn, reps: int) -> dict:
    """GPU milliseconds per call of ``fn``, per kernel name (torch.profiler over ``reps`` calls)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or 0
        if us > 0 and not e.key.startswith(("aten::", "cuda")):
            rows[e.key[:100]] = round(us / 1e3 / reps, 4)
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=None, help="folder with sparse_attention.py and sparse_kernels.py to compare against")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--past", type=int, default=262144)
    ap.add_argument("--page-budget", type=int, default=64)
    ap.add_argument("--sink-pages", type=int, default=1)
    ap.add_argument("--local-pages", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", action="store_true",
                    help="also GPU milliseconds per kernel of one forward + backward of each variant (torch.profiler)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("sparse_kernels_ab.py: needs a CUDA GPU (the kernels are timed)")
    dev, dt = torch.device("cuda"), torch.bfloat16
    C, Hq, Hkv, D, S, past = args.chunk, args.heads, args.kv_heads, args.head_dim, args.page_size, args.past
    gen = torch.Generator().manual_seed(0)
    n = -(-past // S)
    P = n + 2
    mk = lambda *shape: torch.randn(*shape, generator=gen).to(dev, dt)  # noqa: E731
    q, k, v, dout = mk(C, Hq, D), mk(C, Hkv, D), mk(C, Hkv, D), mk(C, Hq, D)
    k_cache, v_cache = mk(P, S, Hkv, D), mk(P, S, Hkv, D)
    bt = torch.randperm(P, generator=gen)[:n].to(dev, torch.int32)
    keys = k_cache[bt.long()].reshape(-1, Hkv, D)[:past]
    sel = select_pages(q, page_representatives(keys, S, "mean"), past, S, args.page_budget, args.sink_pages,
                       args.local_pages, args.block_size, "mean")
    attended = float(sel.counts.float().mean()) * S
    fl_fwd = 4.0 * C * Hq * D * (attended + C / 2)

    def reference(cast):
        t = [x.to(cast) for x in (q, k, v, k_cache, v_cache, dout)]
        out, lse = sparse_attention_fwd_ref(t[0], t[1], t[2], t[3], t[4], bt, past, sel)
        acc = torch.float64 if cast == torch.float64 else torch.float32
        dkc, dvc = torch.zeros(t[3].shape, dtype=acc, device=dev), torch.zeros(t[3].shape, dtype=acc, device=dev)
        dq, dk, dv = sparse_attention_bwd_ref(t[5], t[0], t[1], t[2], out, lse, t[3], t[4], bt, past, dkc, dvc, sel)
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dk_cache=dkc, dv_cache=dvc)

    ref64 = reference(torch.float64)
    ref_lo = reference(dt)
    report = dict(shape=dict(C=C, Hq=Hq, Hkv=Hkv, D=D, page_size=S, past_len=past, page_budget=args.page_budget,
                             sink_pages=args.sink_pages, local_pages=args.local_pages, block_size=args.block_size,
                             attended_past_tokens=attended, dtype=str(dt)),
                  reference_bf16_error={key: rel(val, ref64[key]) for key, val in ref_lo.items()},
                  device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=__import__("triton").__version__, reps=args.reps, variants={})
    del ref_lo
    variants = []
    if args.baseline:
        variants.append(("baseline", load_baseline(args.baseline), KernelConfig()))
    variants += [("today", today, KernelConfig()),
                 ("today_no_tma", today, KernelConfig(fwd_tma=False, bwd_tma=False, dkdv_tma=False))]
    for name, mod, kc in variants:
        dkc = torch.zeros(k_cache.shape, dtype=torch.float32, device=dev)
        dvc = torch.zeros_like(dkc)
        out, lse = mod.sparse_attention_fwd(q, k, v, k_cache, v_cache, bt, past, sel, kernels=kc)
        dq, dk, dv = mod.sparse_attention_bwd(dout, q, k, v, out, lse, k_cache, v_cache, bt, past, dkc, dvc, sel, kernels=kc)
        got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dk_cache=dkc, dv_cache=dvc)
        errors = {key: rel(val, ref64[key]) for key, val in got.items()}
        fwd = lambda: mod.sparse_attention_fwd(q, k, v, k_cache, v_cache, bt, past, sel, kernels=kc)  # noqa: E731
        bwd = lambda: mod.sparse_attention_bwd(dout, q, k, v, out, lse, k_cache, v_cache, bt, past, dkc, dvc, sel,  # noqa: E731
                                               kernels=kc)
        for _ in range(3):  # warm-up after the autotuning calls above
            fwd(), bwd()
        tf, tb = timed(fwd, args.reps), timed(bwd, args.reps)
        f, b = spread(tf), spread(tb)
        report["variants"][name] = dict(
            fwd_ms=f, bwd_ms=b, fwd_tflops=round(fl_fwd / f["median"] / 1e9, 1),
            bwd_tflops=round(2.5 * fl_fwd / b["median"] / 1e9, 1), errors=errors,
            autotuned=autotuned(mod, kc.autotune))
        if args.profile:
            report["variants"][name]["kernel_ms"] = kernel_ms(lambda: (fwd(), bwd()), reps=5)
        print(name, json.dumps(report["variants"][name]), flush=True)
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
