"""Hugging Face integration through transformers' attention interface.

oomb registers one attention implementation, ``"oomb"``, with
``transformers.AttentionInterface``; no model code is copied. The decoder runs
unchanged and calls our function with post-RoPE ``query [1, Hq, C, D]`` and
``key/value [1, Hkv, C, D]`` for each layer; the engine passes the per-chunk
state as the ``oomb_ctx`` keyword, which transformers forwards to the attention
function. Called without ``oomb_ctx`` (generation, evaluation outside the
engine) the function falls back to SDPA, so a wrapped model stays usable.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["ATTN_IMPLEMENTATION", "SUPPORTED_MODEL_TYPES", "UnsupportedModelError", "check_model_config", "check_model_supported",
           "install"]

ATTN_IMPLEMENTATION = "oomb"
SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "mistral", "qwen3")


class UnsupportedModelError(ValueError):
    """The model cannot be trained by oomb; the message says why and what to do."""


def _attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    oomb_ctx: Any = None,
    **kwargs,
):
    if oomb_ctx is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout:
        raise UnsupportedModelError(f"attention dropout ({dropout}) is not supported by oomb; set config.attention_dropout=0")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return oomb_ctx.attend(module.layer_idx, query, key, value, scaling), None


_installed = False


def install() -> None:
    """Register the 'oomb' attention (and its mask function) with transformers. Idempotent."""
    global _installed
    if not _installed:
        AttentionInterface.register(ATTN_IMPLEMENTATION, _attention_forward)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
        _installed = True


def _model_config(model: torch.nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no Hugging Face config; pass a transformers *ForCausalLM model"
        )
    return config


def check_model_config(config: Any) -> None:
    """Raise :class:`UnsupportedModelError` unless oomb can train a model of the transformers ``config``.

    The checks of :func:`check_model_supported` that need no model (its type, sliding-window attention,
    attention dropout), so that ``oomb plan``, ``oomb train`` and :class:`oomb.Engine` refuse a model for the
    same reason in the same words.
    """
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False) or model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported (oomb's engine plugs into the attention of the Qwen2/2.5, "
            f"Llama 2/3, Mistral and Qwen3 implementations only); use a model of type {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "sliding_window", None) is not None or "sliding_attention" in layer_types:
        raise UnsupportedModelError(
            f"sliding-window attention (sliding_window={getattr(config, 'sliding_window', None)}) is not supported; "
            "load the model with sliding_window=None (and use_sliding_window=False) to train it with full attention"
        )
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        raise UnsupportedModelError(
            f"attention_dropout={config.attention_dropout} is not supported; set config.attention_dropout=0"
        )


def check_model_supported(model: torch.nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` unless oomb can train ``model`` exactly.

    Supported: decoder-only causal LMs of the families Qwen2/Qwen2.5, Llama 2/3 (any HF rope
    scaling), Mistral and Qwen3 with full (not sliding-window) attention and no attention dropout
    (:func:`check_model_config` of its config), with an LM head.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` (a name or a path, say).
        UnsupportedModelError: a model oomb cannot train.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers *ForCausalLM), got {type(model).__name__}; "
                        "pass oomb.build_model(name_or_folder) or AutoModelForCausalLM.from_pretrained(folder)")
    check_model_config(_model_config(model))
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no LM head; pass a *ForCausalLM model")


def use_oomb_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` (a HF PreTrainedModel) to the 'oomb' attention implementation."""
    install()
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(ATTN_IMPLEMENTATION)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = ATTN_IMPLEMENTATION
