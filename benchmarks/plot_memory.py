"""Peak GPU memory of one Qwen2.5-7B training step against context length: oomb next to HF.

Reads committed H200 results (same GPU, torch 2.11, transformers 5.17, triton 3.6) and draws
``benchmarks/results/memory_vs_length_h200.png``:

* oomb + offload, fixed GPU page pool (two 32K-token staging segments), dense, chunk 4096:
  ``offload_dense_memory_vs_length_h200.json`` (bench_offload.py part a);
* oomb, every page on the GPU: ``dense_step_memory_vs_hf_h200.json`` and part b of
  ``offload_dense_128k_overhead_h200x2.json`` (128K);
* oomb sparse + offload at 1,048,576 tokens: ``sparse_step_1m_offload_h200x2.json``;
* HF (SDPA + per-layer checkpointing + chunked CE): ``dense_step_memory_vs_hf_h200.json``
  (it runs out of memory beyond ~200K tokens).

Usage: ``python benchmarks/plot_memory.py`` (needs matplotlib).
"""

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

R = os.path.join(os.path.dirname(__file__), "results")


def load(name):
    with open(os.path.join(R, name)) as f:
        return json.load(f)


step = load("dense_step_memory_vs_hf_h200.json")["rows"]
fixed = load("offload_dense_memory_vs_length_h200.json")["a"]
partb = load("offload_dense_128k_overhead_h200x2.json")["b"]
onem = load("sparse_step_1m_offload_h200x2.json")["rows"]

hf = [(r["seq_len"], r["peak_gib"]) for r in step if r["system"] == "hf" and r.get("peak_gib")]
ongpu = [(r["seq_len"], r["peak_gib"]) for r in step if r["system"] == "oomb-triton" and r.get("peak_gib")]
ongpu += [(r["seq_len"], r["peak_gib"]) for r in partb if r["system"] == "all pages on GPU"]
off = [(r["seq_len"], r["peak_gib"]) for r in fixed if r.get("peak_gib")]
sp = [(r["seq_len"], r["peak_gib"]) for r in onem if r.get("peak_gib")]

fig, ax = plt.subplots(figsize=(7, 4.4))
for pts, style, label in (
    (hf, "s-", "HF: SDPA + checkpointing (OOM beyond ~200K)"),
    (sorted(ongpu), "^-", "oomb dense, every KV page on the GPU"),
    (off, "o-", "oomb dense + offload, fixed 512-page GPU pool"),
    (sp, "D", "oomb sparse + offload, 1M tokens (pool 120K pages)"),
):
    if pts:
        ax.plot([t / 1024 for t, _ in pts], [g for _, g in pts], style, label=label)
ax.set_xscale("log", base=2)
ax.set_xlabel("context length (K tokens, log scale)")
ax.set_ylabel("peak GPU memory (GiB)")
ax.set_title("Qwen2.5-7B shape, bf16, one step, NVIDIA H200")
ax.axhline(139.8, color="grey", lw=0.8, ls=":")
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
fig.tight_layout()
out = os.path.join(R, "memory_vs_length_h200.png")
fig.savefig(out, dpi=120)
print(out)
