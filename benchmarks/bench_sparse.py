"""Sparse against dense attention in one training step, in ONE run.

Per context length and system (``dense``, ``sparse``): seconds per step (forward + backward,
no optimizer, gradients kept), tokens/s, peak GPU memory, KV store bytes (GPU pool and
pinned host pages), process RSS. Then the sparse speedup over dense at every length both
ran, and the sparse cost per token at each length relative to the first. Optionally the
gradient-error table of sparse against dense (:func:`oomb.sparse_quality.sparse_grad_error`)
at chosen lengths and page budgets.

A length that runs out of memory is recorded as OOM and the run goes on; ``--dense-max-len``
skips dense above a length (dense at 1M tokens takes over half an hour on an H200).
Writes ``<out>/sparse_<model>_<date><tag>.json`` and ``.md`` after every row.

Example (on the GPU; Qwen2.5-7B shape, bf16, chunk 4096, 64-page budget, offload)::

    PYTHONPATH=. python benchmarks/bench_sparse.py --model qwen2.5-7b \
        --lengths 65536 262144 1048576 --dense-max-len 262144 --offload auto \
        --grad-error-lengths 16384 65536 --grad-error-budgets 4 16 64 --out benchmarks/results

Kernels only (``--kernels``): precision of the Triton sparse kernels in bf16 against the
sparse reference in float64, next to the same reference run on bf16 inputs (flash-attention's
rule: kernel error <= 2x that; for the float32 gradient pages, whose reference keeps p and ds in float32,
2x the larger of that and the exact pages' bf16 rounding), and forward/backward time with TFLOP/s against the dense
kernels over the same number of attended past tokens and over the whole past::

    PYTHONPATH=. python benchmarks/bench_sparse.py --kernels --kernel-past 262144 --out benchmarks/results

On CPU (a smoke test of the script itself)::

    python benchmarks/bench_sparse.py --model tiny --lengths 512 1024 --chunk-size 128 \
        --page-size 16 --page-budget 2 --local-pages 1 --warmup-len 256 --out /tmp/bench
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from oomb import Engine, OOMBConfig  # noqa: E402
from oomb.config import OffloadConfig, SparseConfig  # noqa: E402
from overrides import add_set_argument, apply_sets, config_record  # noqa: E402
from oomb.models.presets import preset_config  # noqa: E402
from oomb.sparse_quality import sparse_grad_error  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

GiB = 1024**3


def build(model_name: str, device: torch.device, dtype: torch.dtype):
    config = preset_config(model_name)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def rss_gib() -> float:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def engine_config(args, sparse: bool, backend: str) -> OOMBConfig:
    cfg = OOMBConfig(
        chunk_size=args.chunk_size, page_size=args.page_size, attention_backend=backend,
        checkpoint_layers=args.checkpoint_layers,
        sparse=SparseConfig(page_budget=args.page_budget, sink_pages=args.sink_pages, local_pages=args.local_pages,
                            block_size=args.block_size, score=args.score) if sparse else None,
        offload=OffloadConfig(mode=args.offload, gpu_page_budget=args.gpu_page_budget))
    return apply_sets(cfg, [s for s in args.sets if sparse or not s.removeprefix("engine.").startswith("sparse.")])


_UNION_SIZES: list[int] = []


def _record_union_sizes() -> None:
    """Count the pages each Stage-2 staging of sparse + offload asks for (benchmark instrumentation)."""
    from oomb.engine.sparse_state import SparseAttentionState

    if getattr(SparseAttentionState.needed_pages, "_bench_wrapped", False):
        return
    orig = SparseAttentionState.needed_pages

    def needed_pages(self, layer, start):
        pages = orig(self, layer, start)
        if pages is not None:
            _UNION_SIZES.append(len(pages))
        return pages

    needed_pages._bench_wrapped = True
    SparseAttentionState.needed_pages = needed_pages


def autotuned_configs() -> dict:
    """The config each autotuned attention kernel chose, per autotune key, in this process ({} without Triton):
    losses from different processes or machines are comparable only where these agree (the key leaves out lengths, and a fresh
    machine re-times the configs)."""
    out = {}
    for mod in ("oomb.ops.triton.paged_fwd_kernel", "oomb.ops.triton.paged_bwd_kernels",
                "oomb.ops.triton.sparse_kernels"):
        m = sys.modules.get(mod)
        for name, obj in vars(m).items() if m is not None else ():
            if not name.endswith("_kernel") or not hasattr(obj, "configs"):
                continue
            for autotune in ("full", "first"):  # a TunedKernel: one autotuner per autotune setting
                cache = getattr(obj[autotune], "cache", None)
                if isinstance(cache, dict) and cache:
                    out[name if autotune == "full" else f"{name}[first]"] = {str(k): str(v) for k, v in cache.items()}
    return out


def memory_breakdown(engine, args, seq_len: int, peak_gib: float) -> dict:
    """What the allocator's peak was made of (GiB), to check the planner's activation estimate and reserve: peak
    reserved (allocated plus the allocator's cache and fragmentation), weights, gradients, the KV store's GPU
    bytes, the sparse state, the rest of the allocated peak ("activations_measured_gib") and what
    :func:`oomb.planner.activation_bytes` predicts for it (choose_engine_tiering's argument values)."""
    from oomb.ops.paged_attention import step_backend
    from oomb.memory import ModelShape, activation_bytes, sparse_state_bytes

    cfg = engine.config
    shape = ModelShape.from_config(engine._base.config)
    params = list(engine.model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    state = sparse_state_bytes(shape, seq_len, cfg, engine.dtype) if cfg.sparse else 0
    # the backend choose_engine_tiering sizes with (sparse: the block-table kernels behind 'sdpa')
    backend = step_backend(cfg, engine.device)
    act = activation_bytes(shape, min(cfg.chunk_size, seq_len), engine.dtype, cfg.checkpoint_layers, backend,
                           cfg.attention_block_size, cfg.loss_chunk_size, max(seq_len - cfg.chunk_size, 0))
    store = engine.kv_store
    gpu_store = store.nbytes + getattr(store, "index_nbytes", 0)  # GPU page buffers (+ block tables)
    rest = peak_gib * GiB - weights - grads - gpu_store - state
    free, total = torch.cuda.mem_get_info()
    # GPU memory held outside torch's allocator (CUDA context, library workspaces, kernel modules), after the step
    outside = total - free - torch.cuda.memory_reserved()
    return dict(peak_reserved_gib=torch.cuda.max_memory_reserved() / GiB, outside_allocator_gib=outside / GiB,
                weights_gib=weights / GiB,
                grads_gib=grads / GiB, kv_gpu_bytes_gib=gpu_store / GiB, sparse_state_gib=state / GiB,
                activations_measured_gib=rest / GiB, activations_planned_gib=act["total"] / GiB,
                gpu_total_gib=total / GiB)


def step(model, args, sparse: bool, backend: str, ids: torch.Tensor, device: torch.device) -> dict:
    _record_union_sizes()
    _UNION_SIZES.clear()
    engine = Engine(model, engine_config(args, sparse, backend))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    # The page store is allocated once per run and reused by every step of that length (oomb train
    # reserves it before the first step); pinning ~75 GiB of host memory for a 1M-token store takes
    # ~30 s. Time it apart, so the step time is the steady-state one.
    t_res = time.perf_counter()
    engine.reserve(ids.shape[1])
    if device.type == "cuda":
        torch.cuda.synchronize()
    reserve_seconds = time.perf_counter() - t_res
    t0 = time.perf_counter()
    out = engine.step(ids, progress=getattr(args, "progress", False))
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    store = engine.kv_store
    state = engine.sparse_state
    row = dict(
        seconds=dt, tokens_per_s=ids.shape[1] / dt, loss=out.loss, reserve_seconds=reserve_seconds,
        stage1_seconds=out.stage1_seconds, stage2_seconds=out.stage2_seconds,
        peak_gib=None if device.type != "cuda" else torch.cuda.max_memory_allocated() / GiB,
        kv_store_gib=out.kv_store_bytes / GiB,
        host_kv_gib=getattr(store, "host_nbytes", 0) / GiB,
        offloaded=type(store).__name__ != "PagedKVStore",
        page_summaries_gib=None if state is None else state.reps.nbytes / GiB,
        rss_gib=rss_gib(),
    )
    if device.type == "cuda":
        row.update(memory_breakdown(engine, args, ids.shape[1], row["peak_gib"]))
    if engine.tiering is not None:
        row["tiering_gib"] = {k: (v / GiB if k.endswith("_bytes") else v) for k, v in engine.tiering.items()}
    row["autotuned"] = autotuned_configs()
    # the engine's settings (stash, shadow, grain, sets, copy kernel) and the allocator's
    row["config"] = config_record(engine.config)
    row["env"] = {k: v for k, v in os.environ.items() if k == "PYTORCH_CUDA_ALLOC_CONF"}
    for attr in ("resident_pages_per_layer", "staging_sets", "stage1_shadow_pages", "kv_stash_tiles", "stage_grain",
                 "gather_programs"):
        if hasattr(store, attr):
            row[attr] = getattr(store, attr)
    stats = getattr(store, "stats", None)
    if stats:
        row["offload_stats"] = dict(stats)
    if _UNION_SIZES:
        u = sorted(_UNION_SIZES)
        row["stage2_staged_pages"] = dict(uses=len(u), mean=sum(u) / len(u), median=u[len(u) // 2], max=u[-1])
    del engine
    return row


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def kernel_report(args, device: torch.device) -> dict:
    """Precision (bf16 kernel vs bf16 reference, both against float64) and, on CUDA, speed of the sparse kernels."""
    from oomb.ops.sparse_attention_ref import sparse_attention_bwd_ref, sparse_attention_fwd_ref
    from oomb.ops.sparse_representatives import page_representatives
    from oomb.ops.sparse_select import PageSelection, select_pages
    from oomb.ops.triton import paged_attention as tpa
    from oomb.ops.triton import sparse_attention as tsa

    C, Hq, Hkv, D, S, past = args.kernel_chunk, args.kernel_heads, args.kernel_kv_heads, args.kernel_head_dim, args.page_size, args.kernel_past
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    n = -(-past // S)
    P = n + 2
    mk = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    q, k, v, dout = mk(C, Hq, D), mk(C, Hkv, D), mk(C, Hkv, D), mk(C, Hq, D)
    k_cache, v_cache = mk(P, S, Hkv, D), mk(P, S, Hkv, D)
    bt = torch.randperm(P, generator=gen)[:n].to(device=device, dtype=torch.int32)
    keys = k_cache[bt.long()].reshape(-1, Hkv, D)[:past]
    sel = select_pages(q, page_representatives(keys, S, args.score), past, S, args.page_budget, args.sink_pages,
                       args.local_pages, args.block_size, args.score)
    report = dict(C=C, Hq=Hq, Hkv=Hkv, D=D, page_size=S, past_len=past, selected_pages_per_block=sel.page_idx.shape[2],
                  dense_selection=sel.dense, dtype=str(dtype))

    def run_ref(cast):
        t = [x.to(cast) for x in (q, k, v, k_cache, v_cache, dout)]
        sel_c = PageSelection(sel.page_idx, sel.counts, sel.block_size, sel.n_past_pages, sel.dense)
        out, lse = sparse_attention_fwd_ref(t[0], t[1], t[2], t[3], t[4], bt, past, sel_c)
        acc = torch.float64 if cast == torch.float64 else torch.float32
        dkc, dvc = torch.zeros(t[3].shape, dtype=acc, device=device), torch.zeros(t[3].shape, dtype=acc, device=device)
        dq, dk, dv = sparse_attention_bwd_ref(t[5], t[0], t[1], t[2], out, lse, t[3], t[4], bt, past, dkc, dvc, sel_c)
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dk_cache=dkc, dv_cache=dvc)

    ref64, ref_lo = run_ref(torch.float64), run_ref(dtype)
    out, lse = tsa.sparse_attention_fwd(q, k, v, k_cache, v_cache, bt, past, sel)
    dkc = torch.zeros(k_cache.shape, dtype=torch.float32, device=device)
    dvc = torch.zeros_like(dkc)
    dq, dk, dv = tsa.sparse_attention_bwd(dout, q, k, v, out, lse, k_cache, v_cache, bt, past, dkc, dvc, sel)
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dk_cache=dkc, dv_cache=dvc)
    report["precision"] = {name: dict(kernel=_rel(got[name], ref64[name]), reference_low=_rel(ref_lo[name], ref64[name]))
                           for name in got}
    # The gradient pages are float32 sums whose products the kernels, as every flash-style kernel, take on p and ds
    # rounded to the input dtype, where the reference keeps them in float32 (its error there is ~1e-5 in bf16,
    # below what any bf16-product kernel reaches): their floor is the error of the exact pages rounded to the
    # input dtype, the precision of those products.
    for name in ("dk_cache", "dv_cache"):
        report["precision"][name]["dtype_rounding"] = _rel(ref64[name].to(dtype), ref64[name])
    report["precision_pass"] = all(r["kernel"] <= 2 * max(r["reference_low"], r.get("dtype_rounding", 0.0)) + 1e-6
                                   for r in report["precision"].values())
    if device.type == "cuda":
        from triton.testing import do_bench

        attended = int(sel.counts.float().mean().item()) * S
        fl_fwd = lambda past_tokens: 4.0 * C * Hq * D * (past_tokens + C / 2)  # noqa: E731
        timings = {}
        timings["sparse_fwd_ms"] = do_bench(lambda: tsa.sparse_attention_fwd(q, k, v, k_cache, v_cache, bt, past, sel))
        timings["sparse_bwd_ms"] = do_bench(lambda: tsa.sparse_attention_bwd(dout, q, k, v, out, lse, k_cache, v_cache, bt,
                                                                             past, dkc, dvc, sel))
        for label, pl in (("dense_same_tokens", attended), ("dense_full_past", past)):
            o, l = tpa.paged_attention_fwd(q, k, v, k_cache, v_cache, bt, pl)
            timings[f"{label}_fwd_ms"] = do_bench(lambda: tpa.paged_attention_fwd(q, k, v, k_cache, v_cache, bt, pl))
            timings[f"{label}_bwd_ms"] = do_bench(lambda: tpa.paged_attention_bwd(dout, q, k, v, o, l, k_cache, v_cache, bt,
                                                                                  pl, dkc, dvc))
        timings["attended_past_tokens"] = attended
        timings["sparse_fwd_tflops"] = fl_fwd(attended) / timings["sparse_fwd_ms"] / 1e9
        timings["sparse_bwd_tflops"] = 2.5 * fl_fwd(attended) / timings["sparse_bwd_ms"] / 1e9
        timings["dense_same_tokens_fwd_tflops"] = fl_fwd(attended) / timings["dense_same_tokens_fwd_ms"] / 1e9
        timings["dense_same_tokens_bwd_tflops"] = 2.5 * fl_fwd(attended) / timings["dense_same_tokens_bwd_ms"] / 1e9
        report["speed"] = timings
    return report


def default_warmup_len(args) -> int:
    """Shortest warm-up whose later chunks have more past pages than the selection holds (so the sparse
    kernels and selection run, not the exactly-dense path), plus two chunks, in whole chunks; at least 8K."""
    pages = args.page_budget + args.sink_pages + args.local_pages + 1
    tokens = pages * args.page_size + 2 * args.chunk_size
    return max(8192, -(-tokens // args.chunk_size) * args.chunk_size)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[65536, 262144, 1048576])
    ap.add_argument("--systems", nargs="+", default=["dense", "sparse"], choices=["dense", "sparse"])
    ap.add_argument("--dense-max-len", type=int, default=None, help="skip dense above this length")
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--page-budget", type=int, default=64)
    ap.add_argument("--sink-pages", type=int, default=1)
    ap.add_argument("--local-pages", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=128, help="queries per selection block")
    ap.add_argument("--score", default="mean", choices=["mean", "quest"])
    ap.add_argument("--offload", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--checkpoint-layers", action="store_true")
    ap.add_argument("--backend", default=None, help="attention backend (default: triton on CUDA, torch on CPU)")
    ap.add_argument("--warmup-len", type=int, default=None,
                    help="tokens of one untimed warm-up step per system; default: long enough that sparse attention "
                         "really selects (past beyond budget + sink + local pages, plus two chunks), so the timed rows "
                         "compile nothing (after an 8K warm-up a 64K row still compiled kernel variants: 25.9 s instead of 12.4)")
    ap.add_argument("--grad-error-lengths", type=int, nargs="*", default=[])
    ap.add_argument("--grad-error-budgets", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--kernels", action="store_true", help="only the kernel precision/speed report (see above)")
    ap.add_argument("--kernel-past", type=int, default=262144, help="--kernels: past tokens")
    ap.add_argument("--kernel-chunk", type=int, default=4096, help="--kernels: queries")
    ap.add_argument("--kernel-heads", type=int, default=28)
    ap.add_argument("--kernel-kv-heads", type=int, default=4)
    ap.add_argument("--kernel-head-dim", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    add_set_argument(ap)
    ap.add_argument("--gpu-page-budget", type=int, default=None,
                    help="with offload: GPU page-pool size in pages (default: the planner's largest that fits)")
    ap.add_argument("--progress", action="store_true", help="tqdm bars over each step's chunks (stderr)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if args.kernels:
        report = kernel_report(args, device)
        os.makedirs(args.out, exist_ok=True)
        name = torch.cuda.get_device_name().replace(" ", "-") if device.type == "cuda" else "cpu"
        path = os.path.join(args.out, f"sparse_kernels_{name}_{_dt.date.today().isoformat()}{args.tag}.json")
        report["versions"] = dict(torch=torch.__version__, triton=__import__("triton").__version__)
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print(json.dumps(report, indent=2))
        return 0 if report["precision_pass"] else 1
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = args.backend or ("triton" if device.type == "cuda" else "torch")
    model = build(args.model, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows, grad_tables = [], []
    meta = dict(
        date=_dt.date.today().isoformat(),
        gpu=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, transformers=__import__("transformers").__version__,
        triton=__import__("triton").__version__ if __import__("importlib").util.find_spec("triton") else None,
        model=args.model, params=n_params, dtype=str(dtype), backend=backend, config=vars(args),
        note="one step = forward + backward, no optimizer, gradients kept; peak = torch.cuda.max_memory_allocated; "
             "rss = peak process RSS so far",
    )
    stem = os.path.join(args.out, f"sparse_{args.model}_{meta['date']}{args.tag}")

    def ids_of(T):
        return torch.randint(0, min(vocab, 32000), (1, T), generator=gen).to(device)

    def write_results() -> str:
        by = {(r["system"], r["seq_len"]): r for r in rows if r.get("seconds")}
        summary = []
        first_sparse = next((r for r in rows if r["system"] == "sparse" and r.get("seconds")), None)
        for T in args.lengths:
            d, s = by.get(("dense", T)), by.get(("sparse", T))
            summary.append(dict(
                seq_len=T,
                speedup=None if not (d and s) else d["seconds"] / s["seconds"],
                sparse_cost_per_token_vs_first=None if not (s and first_sparse)
                else (s["seconds"] / T) / (first_sparse["seconds"] / first_sparse["seq_len"]),
            ))
        os.makedirs(args.out, exist_ok=True)
        with open(stem + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows, summary=summary, grad_error=grad_tables), f, indent=2)
        fmt = lambda v, f: "—" if v is None else format(v, f)  # noqa: E731
        lines = [
            f"# Sparse vs dense training step, {args.model} ({n_params / 1e9:.2f}B params, {dtype}), {meta['gpu']}, {meta['date']}",
            "",
            f"torch {meta['torch']}, transformers {meta['transformers']}, triton {meta['triton']}; backend {backend}; "
            f"chunk {args.chunk_size}, page {args.page_size}; budget {args.page_budget} + sink {args.sink_pages} + local "
            f"{args.local_pages} pages per {args.block_size}-query block, score {args.score}; offload {args.offload}.",
            "",
            "| system | tokens | s/step | stage 1 s | stage 2 s | tok/s | peak GPU GiB | KV GPU GiB | KV host GiB | "
            "summaries GiB | RSS GiB | loss | store alloc s (once per run, not in s/step) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if r.get("error"):
                lines.append(f"| {r['system']} | {r['seq_len']} | {r['error']} |" + " |" * 10)
            else:
                lines.append(
                    f"| {r['system']} | {r['seq_len']} | {r['seconds']:.2f} | {r['stage1_seconds']:.1f} | "
                    f"{r['stage2_seconds']:.1f} | {r['tokens_per_s']:.0f} | "
                    f"{fmt(r['peak_gib'], '.1f')} | {r['kv_store_gib']:.2f} | {r['host_kv_gib']:.2f} | "
                    f"{fmt(r['page_summaries_gib'], '.3f')} | {r['rss_gib']:.1f} | {r['loss']:.4f} | "
                    f"{fmt(r.get('reserve_seconds'), '.1f')} |"
                )
        lines += ["", "| tokens | sparse speedup over dense | sparse cost/token vs shortest |", "|---|---|---|"]
        for s in summary:
            lines.append(f"| {s['seq_len']} | {fmt(s['speedup'], '.2f')} | {fmt(s['sparse_cost_per_token_vs_first'], '.2f')} |")
        for g in grad_tables:
            lines += ["", f"## Gradient error of sparse vs dense at {g['seq_len']} tokens", "", g["table"]]
        text = "\n".join(lines) + "\n"
        with open(stem + ".md", "w") as f:
            f.write(text)
        return text

    if args.warmup_len is None:
        args.warmup_len = default_warmup_len(args)
    for system in args.systems:
        sparse = system == "sparse"
        try:  # warm-up: compilation, autotuning, allocator
            step(model, args, sparse, backend, ids_of(min(args.warmup_len, min(args.lengths))), device)
        except torch.OutOfMemoryError:
            pass
        model.zero_grad(set_to_none=True)
        # Free the warm-up's engine and store before the timed steps size their pools from the free memory.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for T in args.lengths:
            row = dict(system=system, seq_len=T)
            if not sparse and args.dense_max_len is not None and T > args.dense_max_len:
                row["error"] = f"skipped (> --dense-max-len {args.dense_max_len})"
            else:
                try:
                    row.update(step(model, args, sparse, backend, ids_of(T), device))
                except torch.OutOfMemoryError as exc:
                    row["error"] = "out of memory"
                    row["oom_message"] = str(exc).splitlines()[0][:600]
                    if device.type == "cuda":
                        row["peak_gib_at_oom"] = torch.cuda.max_memory_allocated() / GiB
            model.zero_grad(set_to_none=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
            write_results()

    for T in args.grad_error_lengths:
        report = sparse_grad_error(model, ids_of(T), engine_config(args, True, backend), budgets=args.grad_error_budgets)
        grad_tables.append({**report.to_dict(), "table": report.table()})
        model.zero_grad(set_to_none=True)
        write_results()

    print(write_results())


if __name__ == "__main__":
    main()
