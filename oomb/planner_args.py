"""Command-line arguments of the memory planner (``oomb plan``, and the offload options of ``oomb train``).

Kept apart from :mod:`oomb.planner`, which imports torch: building the ``oomb`` parser (``--help``,
``--version``, argument errors) then needs no heavy import.
"""

from __future__ import annotations

import argparse
from typing import Any

HOST_FRACTION = 0.75
"""Share of the available host RAM the pinned KV host tier may take (the planner's and the engine's budget)."""

SMALL_SEGMENT_TOKENS = 4096
"""An --offload-segment-pages below this many tokens' worth (an eighth of the default 32K segment) is warned
about: each segment costs its own host-to-device copies, attention call and merge, whose fixed cost then
outweighs the segment's copy and compute time (an estimate from the 32K segment's ~6 ms of copies, not a measured
cut-off)."""

SPARSE_DEFAULTS = {"page_budget": 64, "sink_pages": 1, "local_pages": 8, "sparse_score": "mean"}
"""Defaults of the sparse options of ``oomb train`` and ``oomb plan`` (``oomb eval``: all but the budget). The
CLI refuses a value other than these while sparse attention is off: it would be ignored."""


def position_limit(config: Any) -> int | None:
    """The longest sequence a transformers ``config`` declares its positions for: ``max_position_embeddings``,
    or ``original_max_position_embeddings x factor`` of a RoPE scaling (rope_parameters / rope_scaling) when
    that is longer; None if the config gives none."""
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        return None
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(config, attr, None)
        if isinstance(params, dict) and params.get("rope_type", params.get("type", "default")) != "default":
            factor, orig = params.get("factor"), params.get("original_max_position_embeddings", limit)
            if isinstance(factor, (int, float)) and factor > 0 and isinstance(orig, (int, float)):
                limit = max(limit, int(orig * factor))
    return limit


def context_length_warning(config: Any, seq_len: int, model: str) -> str | None:
    """A warning (not an error: RoPE computes any position) when ``seq_len`` exceeds the positions model
    ``model``'s ``config`` declares (:func:`position_limit`); None otherwise. One text for ``oomb plan`` and
    ``oomb train``."""
    limit = position_limit(config)
    if limit is None or seq_len <= limit:
        return None
    return (f"oomb: warning: --seq-len {seq_len:,} exceeds the {limit:,} positions model {model!r} declares "
            "(max_position_embeddings): positions beyond them were not trained, so the loss there may be poor; "
            "extend RoPE with 'oomb train --rope-scaling' (e.g. type=yarn,factor=N,original_max_position_embeddings="
            f"{limit}) or use a --seq-len of {limit:,} or less")


def lora_rank_problem(config: Any, rank: int, model: str) -> tuple[str, str] | None:
    """(problem, fix) when LoRA rank ``rank`` exceeds the smaller dimension of every layer it adapts (the q/k/v/o
    projections of model ``model``'s ``config``): such an adapter has more parameters than the full update it can
    express, and trains far slower for nothing (fresh-user review: --lora-rank 99999 on tiny gave 358M trainable
    parameters for a 4.9M model). None otherwise. One check for ``oomb train`` and ``oomb plan``."""
    h, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q, kv = heads * head_dim, (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    limit = max(min(h, q), min(h, kv))
    if rank <= limit:
        return None
    layers = f"q/o projections {h} x {q}" + (f", k/v {h} x {kv}" if kv != q else ", k/v alike")
    return (f"--lora-rank {rank} is larger than the layers it adapts ({layers} in model {model!r})",
            f"pass a rank of at most {limit} (8-64 is usual), or --lora-rank 0 for a full fine-tune")


def add_sparse_arguments(parser, when: str = "with --sparse", budget: bool = True) -> None:
    """--page-budget (when ``budget``), --sink-pages, --local-pages and --sparse-score, defaults from
    :data:`SPARSE_DEFAULTS`, for train, plan, eval and grad-error alike; ``when`` names the flag that turns
    them on (its help prefix)."""
    if budget:
        parser.add_argument("--page-budget", type=int, default=SPARSE_DEFAULTS["page_budget"],
                            help=f"{when}: past pages selected per query block and KV head")
    parser.add_argument("--sink-pages", type=int, default=SPARSE_DEFAULTS["sink_pages"], help=f"{when}: first pages always attended")
    parser.add_argument("--local-pages", type=int, default=SPARSE_DEFAULTS["local_pages"],
                        help=f"{when}: latest past pages always attended")
    parser.add_argument("--sparse-score", choices=["mean", "quest"], default=SPARSE_DEFAULTS["sparse_score"],
                        help=f"{when}: page score (mean key, or Quest's min/max bound)")


def add_save_attention_argument(parser: Any) -> None:
    """``--save-attention {off,gpu,host}`` (``oomb train`` and ``oomb plan``; see ``OOMBConfig.save_attention``)."""
    parser.add_argument("--save-attention", choices=["off", "gpu", "host"], default="off",
                        help="keep Stage 1's attention outputs so the Stage-2 recompute skips its attention forward (same "
                             "gradients, ~22%% less attention work; Hq x head-dim values per token and layer, 7,280 bytes "
                             "for Qwen2.5-7B in bf16) on the GPU or in pinned host memory (on the CPU both in ordinary memory); with offload its Stage-2 "
                             "forwards stage no past either; not used with --sparse under offload")


def add_grad_accum_dtype_argument(parser: Any) -> None:
    """``--grad-accum-dtype {param,float32}`` (``oomb train`` and ``oomb plan``; see ``OOMBConfig.grad_accum_dtype``)."""
    parser.add_argument("--grad-accum-dtype", choices=["param", "float32"], default="param",
                        help="dtype in which each chunk's parameter gradients are summed during a step: param (bf16 "
                             "parameters round the sum once per chunk) or float32 (rounded once per step, as "
                             "full-sequence training does; 4 instead of 2 bytes per bf16 trainable parameter during "
                             "the step)")


def add_offload_arguments(parser: Any) -> None:
    """``--offload {auto,on,off}``, ``--gpu-page-budget PAGES`` and ``--offload-segment-pages PAGES`` (for
    ``oomb train`` and ``oomb plan``)."""
    parser.add_argument("--offload", choices=["auto", "on", "off"], default="auto",
                        help="KV pages in pinned host memory with a GPU tier; auto: only when they do not all fit on the GPU")
    parser.add_argument("--gpu-page-budget", type=int, default=None,
                        help="with offload: GPU page-pool size in pages (page = page-size tokens of one layer's K, V, dK, dV), "
                             "staging included; default: on a GPU the largest that fits, on the CPU (a simulation) the minimum. One that holds "
                             "every page of every layer offloads nothing")
    parser.add_argument("--offload-segment-pages", type=int, default=None,
                        help="with offload: pages per staging segment (the attention reads the past one segment at a "
                             "time, so GPU memory stays flat in the context length); default: 32768 tokens' worth; below "
                             f"{SMALL_SEGMENT_TOKENS} tokens' worth a warning says the segments' copies and calls make "
                             "offload slow. "
                             "Not used by sparse attention, which stages whole layers")


def add_plan_subcommand(subparsers: Any, **parser_kwargs: Any) -> Any:
    """Register ``oomb plan`` on an argparse subparsers object; the handler is :func:`run_plan`."""
    parser_kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
    p = subparsers.add_parser(
        "plan",
        help="predict GPU and host memory of a run and the largest context that fits",
        description="Predict GPU and host memory of one training step before anything is allocated, choose the "
                    "KV tiering (all pages on the GPU, or offload to pinned host memory) and report the largest "
                    "context that fits this machine (or the one described by --gpu-gib/--host-gib; with --gpu-page-budget, "
                    "through that GPU pool).",
        **parser_kwargs,
    )
    p.add_argument("--model", default="qwen2.5-7b", help="a preset name or a local Hugging Face model directory")
    p.add_argument("--seq-len", type=int, default=131072, help="tokens per training sequence")
    p.add_argument("--chunk-size", type=int, default=4096, help="tokens per chunk")
    p.add_argument("--page-size", type=int, default=128, help="tokens per KV page")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="parameter dtype (those oomb train runs: float16 would need loss scaling, which it lacks)")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on q/k/v/o (0: full fine-tune)")
    p.add_argument("--no-optimizer", action="store_true", help="leave out AdamW states (memory of the step alone)")
    p.add_argument("--checkpoint-layers", action="store_true", help="per-layer checkpointing inside each chunk")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton", "sdpa"], default="auto",
                   help="attention implementation; auto counts as sdpa (what it is on cuda): its model-dtype past dK/dV per call are counted; with --sparse, auto and sdpa count as triton (the kernels sparse attention runs)")
    add_save_attention_argument(p)
    add_grad_accum_dtype_argument(p)
    add_offload_arguments(p)
    p.add_argument("--sparse", action="store_true", help="page-level top-K sparse attention (counts its page summaries and "
                   "selections, and offload stages whole layers, as oomb train does)")
    add_sparse_arguments(p)
    p.add_argument("--gpu-gib", type=float, default=None, help="plan for this much free GPU memory (GiB) instead of this machine's "
                                                                     "(needed where no CUDA GPU is visible)")
    p.add_argument("--host-gib", type=float, default=None, help=f"plan for this much available host RAM (GiB) instead of this machine's; the pinned KV host tier may take "
                        f"{HOST_FRACTION * 100:.0f}%% of it")
    p.set_defaults(func=_run_plan)
    return p


def _run_plan(args: Any) -> int:
    from .planner import run_plan

    return run_plan(args)
