"""One training step of oomb next to plain Hugging Face training, on the same model and tokens (``oomb bench``).

Systems:

* ``hf``: the model's own forward with SDPA attention over the whole sequence, per-layer gradient
  checkpointing (non-reentrant) and a chunked cross-entropy (logits for ``loss_block`` tokens at a
  time) -- the strongest plain-transformers setup for long sequences (docs/design.md §1). With the config's
  ``fused_glue='liger'`` it runs the same Liger kernels as the engine (RMSNorm, SwiGLU, RoPE and the fused linear
  cross-entropy in blocks of ``loss_block`` rows: what transformers' Trainer does with ``use_liger_kernel``), so
  the two systems are compared glue for glue;
* ``oomb``: :class:`oomb.Engine` with the given :class:`oomb.OOMBConfig`.

Both are timed at the last of ``steps`` steps on the same sequence (for oomb on one engine): a first step
allocates memory and builds kernels and cuDNN plans (oomb also its page store), which a training run pays
once. One step = forward + backward, no optimizer; gradients are cleared between measurements. Times are wall
seconds around the step with the GPU synchronised before and after; peak memory is
``torch.cuda.max_memory_allocated`` of the step (None on the CPU). A step that runs out of GPU memory is a
row with ``error="out of memory"`` and the run goes on.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable, Sequence

import torch

from .config import OOMBConfig
from .engine.engine import Engine
from .engine.loss import IGNORE_INDEX, chunked_cross_entropy_sum
from .models.fused_glue import FusedGlue
from .memory import is_out_of_memory

__all__ = ["SYSTEMS", "bench_rows", "bench_table", "hf_step", "measure"]

SYSTEMS = ("hf", "oomb")


def hf_step(model: torch.nn.Module, input_ids: torch.Tensor, loss_block: int = 1024,
            glue: FusedGlue | None = None) -> float:
    """One plain-transformers training step on ``input_ids`` ([1, T] int64): SDPA attention, per-layer
    checkpointing, chunked cross-entropy (mean over the T - 1 next-token targets); returns the loss.
    With ``glue`` (a :class:`oomb.models.fused_glue.FusedGlue` of ``model``) the forward and the checkpoint reruns
    in backward run inside ``glue.active()`` and the loss is its fused linear cross-entropy in blocks of
    ``loss_block`` rows. The model's attention implementation is set to 'sdpa' and checkpointing is switched off
    again after."""
    model.set_attn_implementation("sdpa")
    # transformers >= 5.2x renamed these (the old names warn and go in v6)
    new = hasattr(model, "activation_checkpointing_enable")
    if new:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        model.train()
        with glue.active() if glue is not None else contextlib.nullcontext():
            hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state[0]
            targets = torch.cat([input_ids[0, 1:], input_ids.new_full((1,), IGNORE_INDEX)])
            loss_sum = None if glue is None else glue.cross_entropy_sum(hidden, model.lm_head, targets, loss_block)
            if loss_sum is None:
                loss_sum = chunked_cross_entropy_sum(hidden, model.lm_head, targets, loss_block)
            loss = loss_sum / (targets.numel() - 1)
            loss.backward()
    finally:
        model.activation_checkpointing_disable() if new else model.gradient_checkpointing_disable()
    return float(loss.detach())


def measure(fn: Callable[[], object], device: torch.device) -> tuple[float, int | None, object]:
    """Run ``fn`` once -> (wall seconds, peak GPU bytes allocated during it or None on the CPU, its result)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return dt, peak, result


def _clear(model: torch.nn.Module, device: torch.device) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _one(model, system: str, ids: torch.Tensor, config: OOMBConfig, steps: int, device: torch.device) -> dict:
    """Time one system on one sequence, ``steps`` times, the last one kept -> a row (without system/tokens)."""
    engine = Engine(model, config) if system == "oomb" else None
    glue = FusedGlue(model) if system == "hf" and config.fused_glue == "liger" else None
    first = None
    for i in range(steps):
        if i:
            model.zero_grad(set_to_none=True)
        if engine is None:
            dt, peak, loss = measure(lambda: hf_step(model, ids, config.loss_chunk_size, glue), device)
        else:
            dt, peak, out = measure(lambda: engine.step(ids), device)
            loss = out.loss
        first = dt if first is None else first
    row = dict(seconds=dt, peak_bytes=peak, loss=loss, first_step_seconds=first)
    if engine is not None:
        row["kv_store_bytes"] = out.kv_store_bytes
        row["kept_graphs"] = out.kept_graphs
        del engine
    return row


def bench_rows(
    model: torch.nn.Module,
    lengths: Sequence[int],
    config: OOMBConfig,
    systems: Sequence[str] = SYSTEMS,
    steps: int = 2,
    warmup_len: int = 0,
    seed: int = 0,
    progress: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Time ``systems`` on one random sequence per length (the same tokens for every system).

    Args:
        model: a Hugging Face causal LM oomb supports, on its device and dtype. Its ``.grad`` are cleared
            first and after every measurement; its attention implementation is left as the last system set it
            ('sdpa' after hf, oomb's after oomb).
        lengths: tokens per sequence, each >= 2, no repeats.
        config: the oomb engine's settings.
        systems: any of ``"hf"``, ``"oomb"``, in the order to run.
        steps: steps per system and length (for oomb on one engine), the last one timed (>= 1).
        warmup_len: tokens of one untimed warm-up step per system first (0: none).
        seed: seed of the random tokens (ids below min(vocab, 32000)).
        progress: called with each row as it is made.

    Returns:
        Rows ``{system, tokens, seconds, tokens_per_s, peak_bytes, loss, first_step_seconds[, kv_store_bytes,
        kept_graphs]}``,
        or ``{system, tokens, error}`` for a step out of memory, ordered by length, then system.

    Raises:
        ValueError: an unknown or repeated system, a length < 2 or repeated, or ``steps`` < 1.
    """
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems or len(set(systems)) != len(systems):
        raise ValueError(f"systems must be a non-empty list of distinct {SYSTEMS}, got {list(systems)}")
    if any(int(T) < 2 for T in lengths) or not lengths or len(set(lengths)) != len(lengths):
        raise ValueError(f"lengths must be distinct token counts >= 2, got {list(lengths)}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = next(model.parameters()).device
    vocab = min(model.get_input_embeddings().num_embeddings, 32000)
    def tokens(T: int) -> torch.Tensor:  # the same tokens for every system: seeded by (seed, T), made when needed
        gen = torch.Generator().manual_seed(seed * 1_000_003 + T)
        return torch.randint(0, vocab, (1, T), generator=gen).to(device)

    _clear(model, device)
    rows = []
    for system in systems:
        if warmup_len:
            try:
                _one(model, system, tokens(warmup_len), config, 1, device)
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not is_out_of_memory(exc):
                    raise
            _clear(model, device)
        for T in map(int, lengths):
            row = dict(system=system, tokens=T)
            try:
                row.update(_one(model, system, tokens(T), config, steps, device))
                row["tokens_per_s"] = T / row["seconds"]
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not is_out_of_memory(exc):
                    raise
                row = dict(system=system, tokens=T, error="out of memory")
            _clear(model, device)
            rows.append(row)
            if progress is not None:
                progress(row)
    order = {s: i for i, s in enumerate(systems)}
    return sorted(rows, key=lambda r: (lengths.index(r["tokens"]), order[r["system"]]))


def bench_table(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`bench_rows`' rows, with oomb's speed relative to the hf row of the same length and the
    chunk graphs its timed step kept (``keep_graphs``)."""
    hf = {r["tokens"]: r["tokens_per_s"] for r in rows if r["system"] == "hf" and "error" not in r}
    lines = ["| system | tokens | s/step | tokens/s | vs hf | peak GPU GiB | first step s | kept graphs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | {r['tokens']:,} | {r['error']} | | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / hf[r['tokens']]:.2f}x" if r["system"] != "hf" and r["tokens"] in hf else "—"
        peak = "—" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f}"
        first = f"{r['first_step_seconds']:.3f}" if r.get("first_step_seconds") is not None else "—"
        kept = r.get("kept_graphs", "—")
        lines.append(f"| {r['system']} | {r['tokens']:,} | {r['seconds']:.3f} | {r['tokens_per_s']:,.0f} | {ratio} | "
                     f"{peak} | {first} | {kept} |")
    return "\n".join(lines)
