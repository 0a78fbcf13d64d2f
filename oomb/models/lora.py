"""A LoRA adapter on a transformers causal LM (peft), with the layers it adapts chosen by name, and optionally
the embeddings and norms trained beside it (LongLoRA, Chen et al. 2023, arXiv:2309.12307 §3.3: LoRA alone does not
extend the context; trainable embeddings and norms close the gap to full fine-tuning).

The embeddings and norms are peft ``modules_to_save``: peft trains a copy of each, saves it in the adapter's
``adapter_model.safetensors`` and ``PeftModel.from_pretrained`` loads it back; with tied input and output
embeddings the copies stay tied (peft's ``ensure_weight_tying``).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

__all__ = ["ALL_LINEAR", "DEFAULT_TARGETS", "LoraTargetError", "apply_lora", "check_targets", "embedding_norm_modules", "linear_names",
           "merge_adapter", "parse_targets", "resolve_targets"]

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""The attention projections: what ``lora_targets`` adapts by default."""

ALL_LINEAR = "all-linear"
"""Every linear layer but the output projection (peft's ``"all-linear"``)."""


class LoraTargetError(ValueError):
    """``lora_targets`` names modules the model does not have; ``unknown`` and ``available`` are the leaf names."""

    def __init__(self, unknown: Sequence[str], available: Sequence[str]) -> None:
        super().__init__(f"no linear layers named {', '.join(unknown)} (the model has {', '.join(available)})")
        self.unknown, self.available = list(unknown), list(available)


def parse_targets(spec: str) -> tuple[str, ...] | str:
    """``'all-linear'``, or the names of a comma list (``'q_proj, v_proj'`` -> ``('q_proj', 'v_proj')``), in order,
    without repeats. Raises ValueError for an empty list."""
    if spec.strip() == ALL_LINEAR:
        return ALL_LINEAR
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    if not names:
        raise ValueError(f"no module names in {spec!r}")
    return names


def _output_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if get is not None else None


def linear_names(model: torch.nn.Module) -> list[str]:
    """Sorted leaf names of the model's ``nn.Linear`` layers, the output projection (``lm_head``) left out."""
    head = _output_layer(model)
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not head})


def resolve_targets(model: torch.nn.Module, spec: str) -> list[str] | str:
    """The peft ``target_modules`` of ``spec`` (:func:`parse_targets`) on ``model``.

    Raises:
        LoraTargetError: a named module is not a linear layer of ``model``.
    """
    targets = parse_targets(spec)
    if targets == ALL_LINEAR:
        return ALL_LINEAR
    available = linear_names(model)
    unknown = [t for t in targets if t not in available]
    if unknown:
        raise LoraTargetError(unknown, available)
    return list(targets)


def check_targets(config, spec: str) -> None:
    """:func:`resolve_targets` on a model of transformers ``config`` built on the meta device (no weights, no
    memory): a bad ``spec`` is refused before a weight is read.

    Raises:
        LoraTargetError: ``spec`` names a module that is not a linear layer of such a model.
        ValueError: ``spec`` names no module.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    resolve_targets(model, spec)


def embedding_norm_modules(model: torch.nn.Module) -> list[str]:
    """Sorted leaf names of the input embeddings and of every normalisation layer (RMSNorm, LayerNorm: a class
    whose name ends in 'Norm')."""
    embed = model.get_input_embeddings()
    names = set()
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if m is embed or (name and type(m).__name__.endswith("Norm") and any(True for _ in m.parameters(recurse=False))):
            names.add(leaf)
    return sorted(names)


def apply_lora(model: torch.nn.Module, rank: int, alpha: float | None = None, targets: str = ",".join(DEFAULT_TARGETS),
               train_embeddings_norms: bool = False):
    """Wrap ``model`` in a peft LoRA adapter of ``rank`` on the linear layers ``targets`` names
    (:func:`resolve_targets`), scaled by ``alpha / rank`` (``alpha`` None: ``2 * rank``), without dropout; with
    ``train_embeddings_norms`` the input embeddings and the norms are trained too (:func:`embedding_norm_modules`).
    The LoRA init draws from torch's global generator.

    Returns:
        The ``peft.PeftModel``; only the adapter (and those modules' copies) require gradients.

    Raises:
        LoraTargetError: ``targets`` names no linear layer of ``model``.
    """
    from peft import LoraConfig, get_peft_model

    target_modules = resolve_targets(model, targets)
    extra = {}
    if train_embeddings_norms:
        extra = dict(modules_to_save=embedding_norm_modules(model),
                     ensure_weight_tying=bool(getattr(model.config, "tie_word_embeddings", False)))
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=0.0,
                        target_modules=target_modules, task_type="CAUSAL_LM", **extra)
    with warnings.catch_warnings():
        # peft (0.21) reads the model's is_gradient_checkpointing, which transformers 5.x deprecates with a
        # FutureWarning (renamed is_activation_checkpointing); oomb itself does not read it.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


def merge_adapter(base: torch.nn.Module, adapter_dir) -> torch.nn.Module:
    """``base`` with the LoRA adapter of the folder ``adapter_dir`` merged into its weights (``W + alpha / r * B @ A``;
    the embeddings and norms the adapter trained replace the base's): peft's ``merge_and_unload``. ``base`` is
    changed in place.

    Raises:
        ValueError, KeyError, RuntimeError: the adapter does not fit ``base`` (peft's and torch's errors).
    """
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        model = PeftModel.from_pretrained(base, str(adapter_dir))
    return model.merge_and_unload()
