"""Offload benchmark: peak GPU memory vs context length, offload overhead, and the largest context.

Three parts (``--parts a b c``), each next to the memory planner's prediction:

* **a** -- peak GPU memory (``torch.cuda.max_memory_allocated``) of one full
  step (Stage 1 + Stage 2, no optimizer, gradients kept) at several lengths
  with offload on and a fixed GPU tier (``--gpu-page-budget``, default
  ``min``: the two default 32K-token staging segments, every page through host memory), plus
  optionally the plain-HF baseline (SDPA + per-layer checkpointing) at the
  same lengths. The slope (MB per 10K tokens) is fitted over the oomb points.
* **b** -- step time at ``--overhead-len`` (128K) with every page on the GPU,
  with offload and the planner's GPU tier, and with offload and the minimum
  GPU tier; the overhead is relative to all-on-GPU.
* **c** -- at the planner's largest context for this machine (or
  ``--max-len``): Stage 1 and the first Stage-2 chunk (forward + backward),
  where memory peaks; peak GPU memory, pinned host bytes and process RSS
  against the prediction. ``--c-fill store`` (default) fills the KV store
  through the store's own write path (resident pages + D2H through the owned
  buffers) with random K/V instead of running Stage 1's forward, which at 1M
  tokens takes longer than one device command; ``--c-fill stage1`` runs the
  real Stage 1.

Writes ``<out>/offload_<model>_<gpu>_<date>{.json,.md,.png}`` (the PNG: peak
GPU memory against context length, measured and predicted, HF baseline).

Example (H200)::

    PYTHONPATH=. python benchmarks/bench_offload.py --model qwen2.5-7b --parts a \
        --lengths 32768 65536 98304 131072 --hf
    PYTHONPATH=. python benchmarks/bench_offload.py --parts b
    PYTHONPATH=. python benchmarks/bench_offload.py --parts c --checkpoint-layers

CPU smoke test (no GPU memory numbers; checks the script end to end)::

    python benchmarks/bench_offload.py --device cpu --model tiny --lengths 256 512 768 1024 \
        --chunk-size 128 --page-size 32 --overhead-len 512 --max-len 2048 --out /tmp/bench
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from oomb import Engine, OOMBConfig  # noqa: E402
from oomb.config import OffloadConfig  # noqa: E402
from overrides import add_set_argument, apply_sets  # noqa: E402
from oomb.engine import engine as engine_module  # noqa: E402
from oomb.engine.chunk_context import ChunkContext  # noqa: E402
from oomb.engine.loss import chunked_cross_entropy_sum  # noqa: E402
from oomb.engine.offload import OffloadedKVStore  # noqa: E402
from oomb.memory import default_segment_pages, min_gpu_pages, resident_pages_for_budget  # noqa: E402
from oomb.models.presets import preset_config  # noqa: E402
from oomb.ops.paged_attention import resolve_backend  # noqa: E402
from oomb.memory import GiB, Machine, ModelShape, offload_traffic  # noqa: E402
from oomb.planner import plan  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

MB = 1e6


def _rss() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:  # pragma: no cover
        return 0


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device):
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _budget(spec: str, L: int, T: int, page: int) -> int | None:
    """'min' -> the two default-size staging segments; 'auto' -> None (the planner decides); else a page count."""
    if spec == "min":
        return min_gpu_pages(L, -(-T // page), default_segment_pages(page))
    if spec == "auto":
        return None
    return int(spec)


def _partial_step(engine: Engine, ids: torch.Tensor, fill: str) -> dict:
    """Stage 1 (or a direct fill of the KV store) and the first Stage-2 chunk; mirrors Engine.step."""
    input_ids, targets, _, positions = engine._prepare(ids, None)
    T = input_ids.shape[0]
    C = engine.config.chunk_size
    N = -(-T // C)
    device = engine.device
    engine._backend = resolve_backend(engine.config.attention_backend, device)
    engine.model.train()
    store = engine._ensure_store(T)
    if hasattr(engine, "_ensure_sparse"):
        engine._ensure_sparse(T)
    rope = getattr(engine_module, "_rope_state_of_full_sequence", None)
    with rope(engine._decoder, T, device, engine.dtype) if rope is not None else contextlib.nullcontext():
        return _partial_stages(engine, store, input_ids, targets, positions, T, C, N, device, fill)


def _partial_stages(engine, store, input_ids, targets, positions, T, C, N, device, fill) -> dict:
    _sync(device)
    t0 = time.perf_counter()
    if fill == "stage1":
        with torch.no_grad():
            for c in range(N - 1):
                engine._run_chunk(input_ids, positions, ChunkContext(engine, 1, c * C, C, False, None))
    else:
        g = torch.Generator(device=device).manual_seed(0)
        k = torch.randn(C, engine.num_kv_heads, engine.head_dim, generator=g, device=device, dtype=engine.dtype)
        v = torch.randn(C, engine.num_kv_heads, engine.head_dim, generator=g, device=device, dtype=engine.dtype)
        for c in range(N - 1):
            for layer in range(engine.num_layers):
                store.write(layer, c * C, k, v)
    _sync(device)
    t1 = time.perf_counter()
    s = (N - 1) * C
    n = T - s
    n_valid = int((targets != -100).sum())
    hidden = engine._run_chunk(input_ids, positions, ChunkContext(engine, 2, s, n, True, None))
    loss = chunked_cross_entropy_sum(hidden, engine._lm_head, targets[s : s + n], engine.config.loss_chunk_size)
    (loss / n_valid).backward()
    _sync(device)
    t2 = time.perf_counter()
    return {"stage1_seconds": t1 - t0, "stage2_chunk_seconds": t2 - t1, "store": store}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--parts", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 98304, 131072], help="part a")
    ap.add_argument("--overhead-len", type=int, default=131072, help="part b")
    ap.add_argument("--max-len", type=int, default=None, help="part c; default: the planner's largest context")
    ap.add_argument("--c-fill", choices=["store", "stage1"], default="store", help="part c: how the KV store is filled")
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "sdpa"])
    ap.add_argument("--checkpoint-layers", action="store_true")
    ap.add_argument("--gpu-page-budget", default="min", help="part a: 'min' (two default staging segments), 'auto' or a page count")
    ap.add_argument("--hf", action="store_true", help="part a: also the plain-HF baseline at the same lengths")
    ap.add_argument("--warmup-len", type=int, default=8192)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    add_set_argument(ap)
    ap.add_argument("--replot", metavar="JSON", default=None, help="only redraw the PNG of an earlier run's JSON")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            _plot(args.replot[: -len(".json")] if args.replot.endswith(".json") else args.replot, json.load(f))
        return

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # The machine BEFORE anything is allocated: that is what the planner plans against.
    if device.type == "cuda":
        machine = Machine.detect(device)
    else:  # a notional GPU so that predictions print on CPU
        machine = replace_machine(Machine.detect(), 80 * GiB)
    config = preset_config(args.model)
    backend_for_plan = "torch" if args.attention_backend == "torch" or device.type != "cuda" else "triton"
    plan_kw = dict(chunk_size=args.chunk_size, page_size=args.page_size, dtype=dtype, optimizer=None,
                   checkpoint_layers=args.checkpoint_layers, attention_backend=backend_for_plan, machine=machine)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    L = config.num_hidden_layers
    vocab = min(config.vocab_size, 32000)
    gen = torch.Generator().manual_seed(0)
    date = _dt.date.today().isoformat()
    gpu = torch.cuda.get_device_name(device).split()[-1].lower() if device.type == "cuda" else "cpu"
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"offload_{args.model}_{gpu}_{date}{args.tag}")
    results = {
        "model": args.model, "device": machine.gpu_name if device.type == "cuda" else "cpu", "date": date,
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "machine": {"gpu_free_gib": machine.gpu_free_bytes / GiB, "gpu_total_gib": machine.gpu_total_bytes / GiB,
                    "host_available_gib": machine.host_available_bytes / GiB, "host_total_gib": machine.host_total_bytes / GiB},
        "config": vars(args), "a": [], "b": [], "c": [],
    }

    def engine_for(offload, budget):
        cfg = OOMBConfig(chunk_size=args.chunk_size, page_size=args.page_size, attention_backend=args.attention_backend,
                         checkpoint_layers=args.checkpoint_layers, offload=OffloadConfig(mode=offload, gpu_page_budget=budget))
        cfg = apply_sets(cfg, args.sets)
        return Engine(model, cfg)

    def ids_of(T):
        return torch.randint(0, vocab, (1, T), generator=gen).to(device)

    def full_step(T, offload, budget):
        engine = engine_for(offload, budget)
        model.zero_grad(set_to_none=True)
        _reset_memory(device)
        out = engine.step(ids_of(T))
        store = engine.kv_store
        row = dict(seq_len=T, seconds=out.seconds, stage1_seconds=out.stage1_seconds, stage2_seconds=out.stage2_seconds,
                   tokens_per_s=out.tokens_per_s, loss=out.loss, peak_gib=None if out.peak_memory_bytes is None else out.peak_memory_bytes / GiB,
                   kv_gpu_gib=store.nbytes / GiB, offload=isinstance(store, OffloadedKVStore))
        if isinstance(store, OffloadedKVStore):
            row.update(host_pinned_gib=store.host_nbytes / GiB, resident_pages_per_layer=store.resident_pages_per_layer,
                       gpu_pages=store.gpu_pool_pages, h2d_gib=store.stats["h2d_bytes"] / GiB, d2h_gib=store.stats["d2h_bytes"] / GiB,
                       on_demand_stagings=store.stats["on_demand"])
        del engine, store
        return row

    def write():
        with open(stem + ".json", "w") as f:
            json.dump(results, f, indent=1, default=str)
        _write_markdown(stem, results)
        _plot(stem, results)

    # Warm-up: compile/autotune kernels, prime the allocator (untimed).
    tw = min(args.warmup_len, min(args.lengths))
    full_step(tw, True, _budget("min", L, tw, args.page_size))

    if "a" in args.parts:
        for T in args.lengths:
            budget = _budget(args.gpu_page_budget, L, T, args.page_size)
            pred = plan(config, T, offload=True, gpu_page_budget=budget, **plan_kw)
            row = dict(system="oomb-offload", predicted_gib=pred.gpu_peak / GiB, predicted_host_gib=pred.host_kv / GiB)
            try:
                row.update(full_step(T, True, budget))
            except torch.OutOfMemoryError:
                row.update(seq_len=T, error="out of memory")
            results["a"].append(row)
            print(json.dumps(row), flush=True)
            write()
        if args.hf:
            from bench_step import hf_step, measure

            for T in args.lengths:
                row = dict(system="hf", seq_len=T)
                try:
                    model.zero_grad(set_to_none=True)
                    _reset_memory(device)
                    dt, peak, loss = measure(lambda: hf_step(model, ids_of(T)), device)
                    row.update(seconds=dt, peak_gib=None if peak is None else peak / GiB, loss=loss)
                except torch.OutOfMemoryError:
                    row.update(error="out of memory")
                model.set_attn_implementation("oomb")
                results["a"].append(row)
                print(json.dumps(row), flush=True)
                write()

    if "b" in args.parts:
        T = args.overhead_len
        for name, offload, budget in (
            ("all pages on GPU", False, None),
            ("offload, planner's GPU tier", True, None),
            ("offload, minimum GPU tier", True, _budget("min", L, T, args.page_size)),
        ):
            if offload and budget is None:
                p = plan(config, T, offload=True, **plan_kw)
                budget = p.tiering.gpu_pages if p.tiering.offload else None
                if budget is None:  # everything fits: the planner's tier is "all resident"
                    budget = L * -(-T // args.page_size)
            row = dict(system=name)
            if offload:
                SP = default_segment_pages(args.page_size)  # the dense engine stages in segments
                R = resident_pages_for_budget(L, -(-T // args.page_size), budget, SP)
                pred = offload_traffic(ModelShape.from_config(config), T, args.chunk_size, args.page_size, R, dtype,
                                       segment_pages=SP, checkpoint_layers=args.checkpoint_layers)
                row.update(predicted_h2d_gib=pred["h2d_bytes"] / GiB, predicted_d2h_gib=pred["d2h_bytes"] / GiB)
            try:
                row.update(full_step(T, offload, budget))
            except torch.OutOfMemoryError:
                row.update(seq_len=T, error="out of memory")
            results["b"].append(row)
            print(json.dumps(row), flush=True)
        base = next((r for r in results["b"] if r["system"] == "all pages on GPU" and "seconds" in r), None)
        for r in results["b"]:
            if base is not None and "seconds" in r:
                r["overhead"] = r["seconds"] / base["seconds"] - 1
        write()

    if "c" in args.parts:
        p = plan(config, args.max_len or args.chunk_size * 2, offload="auto", **plan_kw)
        T = args.max_len or p.max_seq_len_offload
        p = plan(config, T, offload="auto", **plan_kw)
        print(p.table(), flush=True)
        budget = p.tiering.gpu_pages if p.tiering.offload else None
        engine = engine_for(p.tiering.offload if device.type == "cuda" else True, budget)
        model.zero_grad(set_to_none=True)
        _reset_memory(device)
        rss0 = _rss()
        row = dict(seq_len=T, fill=args.c_fill, predicted_gib=p.gpu_peak / GiB, predicted_host_gib=p.host_kv / GiB,
                   gpu_pages=budget, resident_pages_per_layer=p.tiering.resident_pages_per_layer)
        try:
            r = _partial_step(engine, ids_of(T), args.c_fill)
            store = r.pop("store")
            row.update(r, peak_gib=None if _peak(device) is None else _peak(device) / GiB,
                       host_pinned_gib=getattr(store, "host_nbytes", 0) / GiB, rss_gib=_rss() / GiB, rss_growth_gib=(_rss() - rss0) / GiB)
            del store
        except torch.OutOfMemoryError as exc:
            row.update(error=f"out of memory: {str(exc).splitlines()[0]}")
        del engine
        results["c"].append(row)
        print(json.dumps(row), flush=True)
        write()
    print(open(stem + ".md").read())


def replace_machine(m: Machine, gpu_bytes: int) -> Machine:
    return Machine(gpu_bytes, gpu_bytes, m.host_available_bytes, m.host_total_bytes, "notional GPU (CPU run)")


def _slope_mb_per_10k(rows) -> float | None:
    pts = [(r["seq_len"], r["peak_gib"]) for r in rows if r.get("system") == "oomb-offload" and r.get("peak_gib") is not None]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    return sxy / sxx * GiB / MB * 1e4


def _write_markdown(stem: str, res: dict) -> None:
    f = lambda v, s=".2f": "—" if v is None else format(v, s)  # noqa: E731
    cfg = res["config"]
    lines = [
        f"# Offload, {res['model']}, {res['device']}, {res['date']}",
        "",
        f"torch {res['versions']['torch']}; chunk {cfg['chunk_size']}, page {cfg['page_size']}, backend "
        f"{cfg['attention_backend']}, checkpoint_layers={cfg['checkpoint_layers']}; machine before allocation: "
        f"GPU free {res['machine']['gpu_free_gib']:.1f} GiB, host available {res['machine']['host_available_gib']:.1f} GiB.",
        "",
    ]
    if res["a"]:
        lines += ["## a. Peak GPU memory of one step vs context length", "",
                  "| system | tokens | s/step | peak GiB | predicted GiB | error | host pinned GiB | predicted host GiB |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in res["a"]:
            err = None if r.get("peak_gib") is None or r.get("predicted_gib") is None else (r["predicted_gib"] / r["peak_gib"] - 1) * 100
            lines.append(f"| {r['system']} | {r['seq_len']} | {f(r.get('seconds'))} | {f(r.get('peak_gib'))} | "
                         f"{f(r.get('predicted_gib'))} | {f(err, '+.1f')}% | {f(r.get('host_pinned_gib'))} | "
                         f"{f(r.get('predicted_host_gib'))} |" + (f" {r['error']}" if r.get("error") else ""))
        slope = _slope_mb_per_10k(res["a"])
        lines += ["", f"Fitted slope of oomb's peak: {f(slope, '.1f')} MB per 10K tokens.", ""]
    if res["b"]:
        lines += ["## b. Offload overhead", "",
                  "| system | tokens | s/step | overhead | peak GiB | H2D GiB (predicted) | D2H GiB (predicted) |",
                  "|---|---|---|---|---|---|---|"]
        for r in res["b"]:
            ov = None if r.get("overhead") is None else 100 * r["overhead"]
            lines.append(f"| {r['system']} | {r.get('seq_len')} | {f(r.get('seconds'))} | {f(ov, '+.1f')}% | "
                         f"{f(r.get('peak_gib'))} | {f(r.get('h2d_gib'))} ({f(r.get('predicted_h2d_gib'))}) | "
                         f"{f(r.get('d2h_gib'))} ({f(r.get('predicted_d2h_gib'))}) |")
        lines.append("")
    if res["c"]:
        lines += ["## c. Largest context: Stage 1 + first Stage-2 chunk", "",
                  "| tokens | fill | Stage 1 s | chunk s | peak GiB | predicted GiB | host pinned GiB | predicted host GiB | RSS GiB |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in res["c"]:
            lines.append(f"| {r['seq_len']} | {r['fill']} | {f(r.get('stage1_seconds'))} | {f(r.get('stage2_chunk_seconds'))} | "
                         f"{f(r.get('peak_gib'))} | {f(r.get('predicted_gib'))} | {f(r.get('host_pinned_gib'))} | "
                         f"{f(r.get('predicted_host_gib'))} | {f(r.get('rss_gib'))} |" + (f" {r['error']}" if r.get("error") else ""))
    with open(stem + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")


def _plot(stem: str, res: dict) -> None:
    """PNG of part a; skipped with a note when matplotlib is missing (re-plot later with --replot)."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot; run `python benchmarks/bench_offload.py --replot {stem}.json` where it is")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rows = res["a"]
    for system, style, label in (("oomb-offload", "o-", "oomb + offload (measured)"), ("hf", "s-", "HF SDPA + checkpointing")):
        pts = [(r["seq_len"], r["peak_gib"]) for r in rows if r["system"] == system and r.get("peak_gib") is not None]
        if pts:
            ax.plot([x / 1024 for x, _ in pts], [y for _, y in pts], style, label=label)
    pred = [(r["seq_len"], r["predicted_gib"]) for r in rows if r["system"] == "oomb-offload" and r.get("predicted_gib") is not None]
    if pred:
        ax.plot([x / 1024 for x, _ in pred], [y for _, y in pred], "x--", label="oomb + offload (planner)")
    for r in res["c"]:
        if r.get("peak_gib") is not None:
            ax.plot([r["seq_len"] / 1024], [r["peak_gib"]], "D", label="largest context (Stage 1 + first chunk)")
    ax.set_xlabel("context length (K tokens)")
    ax.set_ylabel("peak GPU memory (GiB)")
    ax.set_title(f"{res['model']} on {res['device']}: peak GPU memory per step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
