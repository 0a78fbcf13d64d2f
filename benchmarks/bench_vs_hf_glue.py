"""oomb against Hugging Face per fused glue, in ONE process: the rows of ``oomb bench`` (:func:`oomb.bench.bench_rows`)
with ``fused_glue`` none, then liger (Liger patches the model for good, so it goes last), ``--repeats`` times each,
so every figure has a min / median / max. With liger the HF step runs the same Liger kernels (glue for glue).
``--keep-graphs off auto`` times oomb once per ``keep_graphs`` value beside the same HF rows.

Each repeat times the second of two steps per system (the first allocates, as in ``oomb bench --steps 2``, and
measures what kept graphs need); the first repeat of each glue follows a ``--warmup-len`` step per system. Appends
one JSON row per (glue, system, keep_graphs, length) to --out and prints a table.

Example (on the GPU)::

    python3 benchmarks/bench_vs_hf_glue.py --lengths 32768 --set engine.attention_backend=sdpa \
        --set engine.save_attention=gpu --keep-graphs off auto --out bench_vs_hf_glue.jsonl
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from oomb import OOMBConfig  # noqa: E402
from oomb.bench import bench_rows  # noqa: E402
from oomb.models.presets import preset_config  # noqa: E402
from overrides import add_set_argument, apply_sets  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768])
    ap.add_argument("--glues", nargs="+", choices=["none", "liger"], default=["none", "liger"])
    ap.add_argument("--keep-graphs", nargs="+", choices=["off", "auto"], default=None,
                    help="engine keep_graphs values to time oomb with (default: the --set value, else off)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup-len", type=int, default=8192)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    add_set_argument(ap)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(preset_config(args.model),
                                                 dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    base = apply_sets(OOMBConfig(chunk_size=4096), args.sets)
    keeps = args.keep_graphs or [base.keep_graphs]
    lines = ["| fused_glue | system | keep_graphs | tokens | s/step min / median / max | peak GiB | kept | loss "
             "| hf s / oomb s |", "|---|---|---|---:|---|---:|---:|---:|---:|"]
    for glue in sorted(set(args.glues), key=["none", "liger"].index):
        runs = {}  # (system, keep_graphs) -> rows of every repeat
        for i in range(args.repeats):
            for j, keep in enumerate(keeps):
                cfg = dataclasses.replace(base, fused_glue=glue, keep_graphs=keep)
                systems = ("hf", "oomb") if j == 0 else ("oomb",)
                rows = bench_rows(model, args.lengths, cfg, systems=systems, steps=2,
                                  warmup_len=args.warmup_len if i == 0 else 0, seed=i)
                for r in rows:
                    runs.setdefault((r["system"], keep if r["system"] == "oomb" else "-"), []).append(r)
        for T in args.lengths:
            hf_median = None
            for (system, keep), all_rows in runs.items():
                rs = [r for r in all_rows if r["tokens"] == T]
                ok = [r for r in rs if "error" not in r]
                row = dict(fused_glue=glue, system=system, keep_graphs=keep, tokens=T, model=args.model,
                           sets=args.sets, gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           torch=torch.__version__, errors=[r["error"] for r in rs if "error" in r])
                if ok:
                    t = [r["seconds"] for r in ok]
                    row.update(times=t, min_s=min(t), median_s=statistics.median(t), max_s=max(t),
                               peak_gib=max(r["peak_bytes"] or 0 for r in ok) / 2**30, losses=[r["loss"] for r in ok],
                               kept_graphs=[r.get("kept_graphs", 0) for r in ok])
                    if system == "hf":
                        hf_median = row["median_s"]
                print(json.dumps(row), flush=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                ratio = f"{hf_median / row['median_s']:.3f}" if system == "oomb" and ok and hf_median else ""
                kept = "/".join(map(str, sorted(set(row["kept_graphs"])))) if ok and system == "oomb" else ""
                lines.append(f"| {glue} | {system} | {keep} | {T:,} | " + (
                    f"{row['min_s']:.3f} / {row['median_s']:.3f} / {row['max_s']:.3f} | {row['peak_gib']:.2f} | "
                    f"{kept} | {row['losses'][-1]:.5f} | {ratio} |" if ok else f"{row['errors'][0]} | | | | |"))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
