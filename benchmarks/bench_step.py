"""One training step of oomb next to the plain Hugging Face baseline, in ONE run.

Per context length and system: seconds per step (forward + backward, no
optimizer, gradients kept), tokens/s and peak GPU memory. Systems:

* ``hf``: the model's own forward with SDPA attention, per-layer gradient
  checkpointing and a chunked cross-entropy (logits for 1024 tokens at a time),
  i.e. the strongest plain-HF setup (docs/design.md §1).
* ``oomb-torch`` / ``oomb-triton`` / ``oomb-sdpa``: :class:`oomb.Engine`, dense, with the
  PyTorch reference attention, the Triton kernels, or cuDNN's fused attention (the 'sdpa' backend).
* ``oomb-<backend>-save-gpu`` / ``oomb-<backend>-save-host``: the same with
  ``save_attention`` (Stage 1's attention outputs kept on the GPU / in pinned
  host memory, so the Stage-2 recompute skips its attention forward).

A length that runs out of memory is recorded as OOM and the run goes on.
Writes ``<out>/step_<model>_<date>.json`` and ``.md``.

Example (on the GPU)::

    PYTHONPATH=. python benchmarks/bench_step.py --model qwen2.5-7b \
        --lengths 32768 131072 --systems hf oomb-triton --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from oomb import Engine, OOMBConfig  # noqa: E402
from overrides import add_set_argument, apply_sets  # noqa: E402
from oomb.bench import hf_step, measure  # noqa: E402  (the same HF step and timing as `oomb bench`)
from oomb.models.presets import preset_config  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

GiB = 1024**3


def build(model_name: str, device: torch.device, dtype: torch.dtype):
    config = preset_config(model_name)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--systems", nargs="+", default=["hf", "oomb-triton"], choices=["hf"] + [f"oomb-{b}{s}" for b in ("torch", "triton", "sdpa") for s in ("", "-save-gpu", "-save-host")])
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--checkpoint-layers", action="store_true",
                    help="per-layer checkpointing inside oomb's Stage-2 chunk recompute (less memory, ~1 more forward)")
    ap.add_argument("--hf-max-len", type=int, default=None,
                    help="skip the HF baseline above this length (it is out of memory past ~200K on an H200)")
    ap.add_argument("--oomb-steps", type=int, default=1,
                    help="steps per oomb engine, the last one timed (2+: steady state, the engine's buffers allocated "
                         "by its first step, as in training; pinned host buffers take seconds to allocate)")
    ap.add_argument("--warmup-len", type=int, default=8192, help="tokens of one untimed warm-up step per system")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="", help="suffix of the result file names")
    add_set_argument(ap)
    ap.add_argument("--profile", type=int, default=None, metavar="TOKENS",
                    help="after the timed rows, profile one step per system at this length (torch.profiler) and "
                         "write the top kernels by GPU time to <out>/profile_<system>_<TOKENS><tag>.txt")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(args.model, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    first_steps = {}  # (system, T) -> seconds of an engine's first step, with --oomb-steps 2+

    def run_system(system: str, T: int):
        ids = torch.randint(0, min(vocab, 32000), (1, T), generator=gen).to(device)
        if system == "hf":
            return measure(lambda: hf_step(model, ids), device)
        backend = system.split("-")[1]
        engine = Engine(model, apply_sets(OOMBConfig(
                chunk_size=args.chunk_size,
                page_size=args.page_size,
                attention_backend=backend,
                checkpoint_layers=args.checkpoint_layers,
                save_attention=system.split("-save-")[1] if "-save-" in system else "off",
            ), args.sets))
        out_holder = {}

        def go():
            out_holder["out"] = engine.step(ids)
            return out_holder["out"].loss

        res = measure(go, device)
        for _ in range(args.oomb_steps - 1):  # the same engine again: its buffers exist, as in training
            model.zero_grad(set_to_none=False)
            first_steps.setdefault((system, T), res[0])
            res = measure(go, device)
        kv = out_holder["out"].kv_store_bytes
        del engine
        model.gradient_checkpointing_disable()
        return res[0], res[1], (res[2], kv)

    def write_results():
        meta = dict(
            date=_dt.date.today().isoformat(),
            gpu=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            torch=torch.__version__,
            transformers=__import__("transformers").__version__,
            triton=getattr(__import__("importlib").util.find_spec("triton"), "name", None) and __import__("triton").__version__,
            model=args.model,
            params=n_params,
            dtype=str(dtype),
            chunk_size=args.chunk_size,
            page_size=args.page_size,
            oomb_checkpoint_layers=args.checkpoint_layers,
            oomb_steps_per_engine=args.oomb_steps,
            note="one step = forward + backward, no optimizer, gradients kept; peak = torch.cuda.max_memory_allocated",
        )
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"step_{args.model}_{meta['date']}{args.tag}")
        with open(stem + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=2)
        lines = [
            f"# One training step, {args.model} ({n_params / 1e9:.2f}B params, {dtype}), {meta['gpu']}, {meta['date']}",
            "",
            f"torch {meta['torch']}, transformers {meta['transformers']}, triton {meta['triton']}; chunk {args.chunk_size}, page {args.page_size}.",
            "",
            "| system | tokens | s/step | tok/s | peak GiB | KV store GiB | peak - KV GiB |",
            "|---|---|---|---|---|---|---|",
        ]
        fmt = lambda v, f: "—" if v is None else format(v, f)  # noqa: E731
        for r in rows:
            if r.get("error"):
                lines.append(f"| {r['system']} | {r['seq_len']} | {r['error']} | | | | |")
            else:
                lines.append(
                    f"| {r['system']} | {r['seq_len']} | {fmt(r['seconds'], '.2f')} | {fmt(r['tokens_per_s'], '.0f')} | "
                    f"{fmt(r['peak_gib'], '.1f')} | {fmt(r.get('kv_store_gib'), '.2f')} | {fmt(r.get('peak_minus_kv_gib'), '.1f')} |"
                )
        with open(stem + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
        return "\n".join(lines)

    for system in args.systems:
        # Warm-up (compilation, autotuning, allocator) once per system, untimed.
        try:
            run_system(system, min(args.warmup_len, min(args.lengths)))
        except torch.OutOfMemoryError:
            pass
        model.zero_grad(set_to_none=False)
        for T in args.lengths:
            row = dict(system=system, seq_len=T)
            if system == "hf" and args.hf_max_len is not None and T > args.hf_max_len:
                row.update(seconds=None, tokens_per_s=None, peak_gib=None, error=f"skipped (> --hf-max-len {args.hf_max_len})")
                rows.append(row)
                continue
            try:
                dt, peak, extra = run_system(system, T)
                loss, kv = (extra, None) if system == "hf" else extra
                row.update(seconds=dt, tokens_per_s=T / dt, peak_gib=None if peak is None else peak / GiB, loss=loss)
                if (system, T) in first_steps:
                    row["first_step_seconds"] = first_steps[(system, T)]
                if kv is not None:
                    row["kv_store_gib"] = kv / GiB
                    if peak is not None:
                        row["peak_minus_kv_gib"] = (peak - kv) / GiB
            except torch.OutOfMemoryError:
                row.update(seconds=None, tokens_per_s=None, peak_gib=None, error="out of memory")
            model.zero_grad(set_to_none=False)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
            write_results()  # after every row: a run cut short still leaves its numbers

    print(write_results())
    if args.profile:
        for system in args.systems:
            profile_step(system, args.profile, run_system, device, args)


def profile_step(system, T, run_system, device, args):
    """One step under torch.profiler: top kernels by GPU time, and GPU busy time against wall time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        dt, _, _ = run_system(system, T)
    ka = prof.key_averages()
    busy_us = sum(e.self_device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
    if device.type == "cuda":
        busy_us = busy_us or sum(e.self_device_time_total for e in ka)
    head = (f"# {system}, {T} tokens, {args.model}: wall {dt:.2f} s (profiler on), "
            f"GPU kernel time {busy_us / 1e6:.2f} s ({100 * busy_us / 1e6 / dt:.0f}% of wall)\n\n")
    table = ka.table(sort_by="self_device_time_total" if device.type == "cuda" else "self_cpu_time_total", row_limit=45,
                     max_name_column_width=90)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"profile_{system}_{T}{args.tag}.txt")
    with open(path, "w") as f:
        f.write(head + table + "\n")
    print(head)


if __name__ == "__main__":
    main()
