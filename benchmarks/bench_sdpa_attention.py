"""GPU check and benchmark of the SDPA (cuDNN) chunk attention, oomb.ops.sdpa_attention, next to the Triton kernels.

Usage (CUDA only)::

    PYTHONPATH=. python benchmarks/bench_sdpa_attention.py --out benchmarks/results/

1. Correctness, bf16 and fp16, as in bench_kernels.py: relative error against the PyTorch reference in
   float32 on the same rounded inputs, which must stay within 2x of the same reference run in bf16/fp16
   (``ref_lp``); the Triton kernels' error on the same case is printed next to it. The past is the first
   pages of the pool in order (the layout the SDPA path serves), passed as strided [past, Hkv, D] views;
   the same call with contiguous [1, Hkv, past, D] copies must give bitwise the same results.
2. Speed: Qwen2.5-7B attention (Hq=28, Hkv=4, D=128), 4096 queries x 32K / 128K past tokens, bf16,
   forward and backward TFLOP/s (bench_kernels.flops) of the SDPA path and of the Triton kernels in the
   same process (``triton.testing.do_bench`` medians).

Writes sdpa_attention_<gpu>_<date>.json/.md under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import CHUNK, PAGE, flops, make_inputs, past_rows, rel_err, run_kernel, run_ref  # noqa: E402

CASES = [
    # name, C, Hq, Hkv, D, past_len, S, dtype, seed
    ("qwen7b-4096x32K-bf16", CHUNK, 28, 4, 128, 32768, PAGE, torch.bfloat16, 1),
    ("qwen7b-4096x32K-fp16", CHUNK, 28, 4, 128, 32768, PAGE, torch.float16, 2),
    ("qwen7b-4096-nopast-bf16", CHUNK, 28, 4, 128, 0, PAGE, torch.bfloat16, 3),
    ("C512-gqa7-d64", 512, 14, 2, 64, 128 * 20, 128, torch.bfloat16, 4),
    ("C384-gqa4-d80-page64", 384, 8, 2, 80, 64 * 37, 64, torch.bfloat16, 5),
    ("C256-gqa1-d96-page256", 256, 6, 6, 96, 256 * 9, 256, torch.float16, 6),
    ("C1000-gqa7-d128", 1000, 14, 2, 128, 128 * 21, 128, torch.bfloat16, 7),
]


def contiguous_past(x, past_len):
    """Make the past the first pages of the pool in order; return [past, Hkv, D] views of K/V and their pages."""
    n = -(-past_len // x["k_cache"].shape[1])
    x["block_table"] = torch.arange(n, dtype=torch.int32, device=x["q"].device)
    return n


def run_sdpa(sa, x, past_len, copies=False):
    n = contiguous_past(x, past_len)
    pk = x["k_cache"][:n].flatten(0, 1)[:past_len]
    pv = x["v_cache"][:n].flatten(0, 1)[:past_len]
    if copies:  # [1, Hkv, past, D] contiguous, seen as [past, Hkv, D]
        pk = pk.transpose(0, 1).contiguous().transpose(0, 1)
        pv = pv.transpose(0, 1).contiguous().transpose(0, 1)
    dk_cache = torch.zeros(x["k_cache"].shape, dtype=torch.float32, device=x["q"].device)
    dv_cache = torch.zeros_like(dk_cache)
    out, lse = sa.sdpa_attention_fwd(x["q"], x["k"], x["v"], pk if past_len else None, pv if past_len else None,
                                     x["q"].shape[-1] ** -0.5)
    dq, dk, dv = sa.sdpa_attention_bwd(
        x["dout"], x["q"], x["k"], x["v"], out, lse, pk if past_len else None, pv if past_len else None,
        dk_cache[:n].flatten(0, 1)[:past_len] if past_len else None,
        dv_cache[:n].flatten(0, 1)[:past_len] if past_len else None, x["q"].shape[-1] ** -0.5)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dk_cache=dk_cache, dv_cache=dv_cache)


def check_case(sa, tpa, name, C, Hq, Hkv, D, past_len, S, dtype, seed):
    x = make_inputs(C, Hq, Hkv, D, past_len, S, dtype, seed)
    got = run_sdpa(sa, x, past_len)
    got_c = run_sdpa(sa, x, past_len, copies=True)
    # Triton only where bench_kernels.py already tuned it (the carried cache): new shapes would autotune for minutes.
    trit = run_kernel(tpa, x, past_len) if tpa is not None and name.startswith("qwen7b-4096x32K") else None
    torch.cuda.synchronize()
    ref32 = run_ref(x, past_len, torch.float32)
    reflp = run_ref(x, past_len)
    bt = x["block_table"]
    names = ["out", "lse", "dq", "dk", "dv"] + (["past_dk", "past_dv"] if past_len else [])

    def view(d, n):
        if n.startswith("past_"):
            return past_rows(d["dk_cache" if n == "past_dk" else "dv_cache"], bt, past_len)
        return d[n]

    res = dict(name=name, C=C, Hq=Hq, Hkv=Hkv, D=D, past_len=past_len, page_size=S, dtype=str(dtype).replace("torch.", ""))
    res["copies_bitwise_equal"] = all(torch.equal(view(got, n), view(got_c, n)) for n in names)
    ok = res["copies_bitwise_equal"]
    errs = {}
    for n in names:
        g = view(got, n)
        finite = bool(torch.isfinite(g).all())
        e = rel_err(g, view(ref32, n))
        e_lp = rel_err(view(reflp, n), view(ref32, n))
        e_t = rel_err(view(trit, n), view(ref32, n)) if trit is not None else None
        passed = finite and e <= 2 * e_lp
        ok &= passed
        errs[n] = dict(sdpa=e, ref_lp=e_lp, triton=e_t, ratio=e / max(e_lp, 1e-30), finite=finite, pass_2x=passed)
    res["errors"] = errs
    res["pass"] = ok
    return res


def bench_speed(sa, tpa, past_len, do_bench):
    C, Hq, Hkv, D = CHUNK, 28, 4, 128
    x = make_inputs(C, Hq, Hkv, D, past_len, PAGE, torch.bfloat16, seed=past_len + 1)
    n = contiguous_past(x, past_len)
    pk = x["k_cache"][:n].flatten(0, 1)[:past_len]
    pv = x["v_cache"][:n].flatten(0, 1)[:past_len]
    dk_cache = torch.zeros(x["k_cache"].shape, dtype=torch.float32, device="cuda")
    dv_cache = torch.zeros_like(dk_cache)
    pdk, pdv = dk_cache[:n].flatten(0, 1)[:past_len], dv_cache[:n].flatten(0, 1)[:past_len]
    scale = D ** -0.5
    out, lse = sa.sdpa_attention_fwd(x["q"], x["k"], x["v"], pk, pv, scale)
    r = dict(past_len=past_len, C=C)
    r["sdpa_fwd_ms"] = do_bench(lambda: sa.sdpa_attention_fwd(x["q"], x["k"], x["v"], pk, pv, scale))
    r["sdpa_bwd_ms"] = do_bench(lambda: sa.sdpa_attention_bwd(x["dout"], x["q"], x["k"], x["v"], out, lse, pk, pv, pdk,
                                                               pdv, scale))
    if tpa is not None:
        o2, l2 = tpa.paged_attention_fwd(x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"], x["block_table"], past_len)
        r["triton_fwd_ms"] = do_bench(lambda: tpa.paged_attention_fwd(x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"],
                                                                      x["block_table"], past_len))
        r["triton_bwd_ms"] = do_bench(lambda: tpa.paged_attention_bwd(
            x["dout"], x["q"], x["k"], x["v"], o2, l2, x["k_cache"], x["v_cache"], x["block_table"], past_len, dk_cache,
            dv_cache))
    for k in [k for k in r if k.endswith("_ms")]:
        r[k.replace("_ms", "_tflops")] = flops(C, past_len, Hq, D, "fwd" if "fwd" in k else "bwd") / r[k] * 1e-9
    return r


def to_markdown(rep):
    L = [f"# SDPA (cuDNN) chunk attention vs Triton kernels, {rep['gpu']}, {rep['date']}", "",
         f"Versions: {rep['versions']}", f"Command: `{rep['command']}`", "", "## Correctness (relative error vs fp32 reference)",
         "", "| case | tensor | sdpa | ref in low precision | ratio | triton | pass |", "|---|---|---|---|---|---|---|"]
    for c in rep["correctness"]:
        if "error" in c:
            L.append(f"| {c['name']} | ERROR {c['error'][:200]} | | | | | |")
            continue
        for n, e in c["errors"].items():
            t = "" if e["triton"] is None else f"{e['triton']:.2e}"
            L.append(f"| {c['name']} | {n} | {e['sdpa']:.2e} | {e['ref_lp']:.2e} | {e['ratio']:.2f} | {t} | {e['pass_2x']} |")
        L.append(f"| {c['name']} | copies bitwise equal | {c['copies_bitwise_equal']} | | | | {c['pass']} |")
    L += ["", "## Speed (4096 queries, Qwen2.5-7B attention, bf16)", "",
          "| past | sdpa fwd ms | TFLOP/s | triton fwd ms | TFLOP/s | sdpa bwd ms | TFLOP/s | triton bwd ms | TFLOP/s |",
          "|---|---|---|---|---|---|---|---|---|"]
    for s in rep["speed"]:
        if "error" in s:
            L.append(f"| {s['past_len']} | ERROR {s['error'][:200]} |")
            continue
        g = lambda k, f="{:.2f}": f.format(s[k]) if k in s else ""  # noqa: E731
        L.append(f"| {s['past_len']} | {g('sdpa_fwd_ms')} | {g('sdpa_fwd_tflops', '{:.0f}')} | {g('triton_fwd_ms')} | "
                 f"{g('triton_fwd_tflops', '{:.0f}')} | {g('sdpa_bwd_ms')} | {g('sdpa_bwd_tflops', '{:.0f}')} | "
                 f"{g('triton_bwd_ms')} | {g('triton_bwd_tflops', '{:.0f}')} |")
    return "\n".join(L) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/")
    ap.add_argument("--tag", default="")
    ap.add_argument("--past", default="32768,131072")
    ap.add_argument("--no-triton", action="store_true", help="leave out the Triton kernels")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_sdpa_attention.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    import oomb.ops.sdpa_attention as sa

    tpa = None
    if not args.no_triton:
        import oomb.ops.triton.paged_attention as tpa
    from triton.testing import do_bench

    def bench(fn):
        return do_bench(fn, warmup=25, rep=300, return_mode="median")

    rep = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), command=" ".join(sys.argv),
               versions=dict(torch=torch.__version__, cudnn=torch.backends.cudnn.version(), cuda=torch.version.cuda,
                             python=platform.python_version()),
               available=sa.sdpa_available(torch.empty(1, 28, 128, device="cuda", dtype=torch.bfloat16)),
               correctness=[], speed=[])
    print("versions", rep["versions"], "available", rep["available"], flush=True)
    t0 = time.time()
    for case in CASES:
        try:
            r = check_case(sa, tpa, *case)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            r = dict(name=case[0], error=f"{type(e).__name__}: {e}")
        rep["correctness"].append(r)
        print(f"[{time.time() - t0:6.1f}s] {r['name']}: " + ("ERROR " + r["error"][:300] if "error" in r else
              ("pass" if r["pass"] else "FAIL") + f" copies_equal={r['copies_bitwise_equal']} " +
              " ".join(f"{n}={e['sdpa']:.2e}/{e['ref_lp']:.2e}/{e['triton'] or 0:.2e}" for n, e in r["errors"].items())),
              flush=True)
    for past in [int(p) for p in args.past.split(",") if p]:
        try:
            r = bench_speed(sa, tpa, past, bench)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            r = dict(past_len=past, error=f"{type(e).__name__}: {e}")
        rep["speed"].append(r)
        print(f"[{time.time() - t0:6.1f}s] speed {r}", flush=True)
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"sdpa_attention_h200_{rep['date']}{args.tag}")
    with open(base + ".json", "w") as f:
        json.dump(rep, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(to_markdown(rep))
    print(to_markdown(rep))


if __name__ == "__main__":
    main()
