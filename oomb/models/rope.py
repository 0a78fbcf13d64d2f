"""Stretch a loaded model's RoPE for longer contexts: rope_theta and Hugging Face rope scaling.

transformers 5 keeps RoPE settings in ``config.rope_parameters`` (``rope_type``,
``rope_theta`` and the type's own keys) and builds the rotary embedding module from it
once, at construction. :func:`set_rope` edits the config and rebuilds every rotary
module in place, so the change is used by the next forward and written by
``save_pretrained``.

Scaling types (transformers' names): ``linear`` (position interpolation, Chen et al. 2023),
``dynamic`` (dynamic NTK), ``yarn`` (Peng et al. 2023), ``llama3`` (Meta's Llama 3.1 recipe).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ROPE_TYPES", "parse_rope_scaling", "set_rope"]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# A complete spec per type, for error messages (Llama 3.1's own values for llama3).
_EXAMPLES = {
    "llama3": "type=llama3,factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192",
    "yarn": "type=yarn,factor=4,original_max_position_embeddings=32768",
}
# Types that stretch the context by ``factor``: transformers only warns on factor < 1 (it would shrink it).
_STRETCH = ("linear", "dynamic", "yarn", "llama3")


def _check_factor(rope_type: Any, factor: Any) -> None:
    """``factor`` is a positive number, and >= 1 for the context-stretching types."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor != factor:
        raise ValueError(f"rope scaling factor must be a number, got {factor!r}; e.g. 'type=linear,factor=4'")
    if factor <= 0:
        raise ValueError(f"rope scaling factor must be > 0, got {factor}; e.g. 'type=linear,factor=4'")
    if rope_type in _STRETCH and factor < 1:
        raise ValueError(
            f"rope scaling factor must be >= 1 for type {rope_type!r} (it stretches the context by factor), got {factor}; "
            f"e.g. 'type={rope_type},factor=4'"
        )


def parse_rope_scaling(text: str) -> dict[str, Any]:
    """Parse ``"type=yarn,factor=4,original_max_position_embeddings=32768"`` into a dict.

    Numbers become int or float; ``type`` is accepted for ``rope_type``.

    Raises:
        ValueError: on an item without ``=``; on a non-empty spec without ``type``/``rope_type``; on a
            ``factor`` that is not a positive number (or below 1 for linear, dynamic, yarn and llama3).
    """
    out: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in item:
            raise ValueError(f"rope scaling item {item!r} is not key=value; e.g. 'type=yarn,factor=4'")
        key, value = (x.strip() for x in item.split("=", 1))
        key = "rope_type" if key == "type" else key
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        out[key] = value
    if out and not out.get("rope_type"):
        raise ValueError(f"rope scaling {text.strip()!r} has no type; add type=..., e.g. 'type=linear,{text.strip()}'")
    if "factor" in out:
        _check_factor(out["rope_type"], out["factor"])
    return out


def set_rope(model: torch.nn.Module, rope_theta: float | None = None, rope_scaling: dict[str, Any] | None = None) -> dict:
    """Change the RoPE of ``model`` (a transformers causal LM, optionally peft-wrapped) in place.

    Args:
        model: the model; its config and rotary embedding modules are updated.
        rope_theta: new RoPE base frequency, or None to keep it.
        rope_scaling: ``{"rope_type": ..., "factor": ..., ...}`` as transformers defines it (``type`` is read
            as ``rope_type``), or None.
            ``max_position_embeddings`` in it (optional) also sets the config's.

    Returns:
        The new ``config.rope_parameters``.

    Raises:
        ValueError: unknown rope type, a missing key the type needs, or a non-positive
            rope_theta or factor.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    params = dict(getattr(config, "rope_parameters", None) or {"rope_type": "default"})
    if rope_theta is not None:
        if rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {rope_theta}")
        params["rope_theta"] = float(rope_theta)
    if rope_scaling:
        scaling = dict(rope_scaling)
        if "type" in scaling:  # transformers' older spelling of rope_type, as parse_rope_scaling reads it
            scaling.setdefault("rope_type", scaling.pop("type"))
        max_pos = scaling.pop("max_position_embeddings", None)
        rope_type = scaling.get("rope_type", params.get("rope_type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; use one of {', '.join(ROPE_TYPES)}")
        missing = [k for k in _REQUIRED.get(rope_type, ()) if k not in scaling and k not in params]
        if missing:
            example = _EXAMPLES.get(rope_type, f"type={rope_type},factor=4")
            raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)}; e.g. '{example}'")
        if "factor" in scaling:
            _check_factor(rope_type, scaling["factor"])
        if rope_type == "default":
            params = {"rope_type": "default", "rope_theta": params.get("rope_theta", 10000.0)}
        params.update(scaling)
        if max_pos is not None:
            config.max_position_embeddings = int(max_pos)
    config.rope_parameters = params
    for name, module in list(base.named_modules()):
        if hasattr(module, "inv_freq") and hasattr(module, "rope_type"):
            device = module.inv_freq.device
            parent_name, _, attr = name.rpartition(".")
            parent = base.get_submodule(parent_name) if parent_name else base
            with torch.device(device):
                setattr(parent, attr, type(module)(config))
    return params
