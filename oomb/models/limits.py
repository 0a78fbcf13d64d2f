"""Limits a model's config sets on a run: the positions it declares, the LoRA ranks that make sense.

One check each for ``oomb train`` and ``oomb plan`` (and any caller): the texts name flags, since the CLI is
where they are shown.
"""

from __future__ import annotations

from typing import Any

__all__ = ["context_length_warning", "lora_rank_problem", "position_limit"]


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
    express, and trains far slower for nothing (--lora-rank 99999 on tiny gives 358M trainable parameters for a
    4.9M model). None otherwise. One check for ``oomb train`` and ``oomb plan``."""
    h, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q, kv = heads * head_dim, (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    limit = max(min(h, q), min(h, kv))
    if rank <= limit:
        return None
    layers = f"q/o projections {h} x {q}" + (f", k/v {h} x {kv}" if kv != q else ", k/v alike")
    return (f"--lora-rank {rank} is larger than the layers it adapts ({layers} in model {model!r})",
            f"pass a rank of at most {limit} (8-64 is usual), or --lora-rank 0 for a full fine-tune")
