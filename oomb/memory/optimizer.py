"""Bytes of each optimizer's state on the GPU and on the host (``train.optimizer``; :mod:`oomb.train.optim`).

Counted per trainable tensor (:func:`trainable_numels`), because the 8-bit states quantize only tensors of at
least :data:`QUANT_MIN_NUMEL` elements that split into whole blocks, as torchao's ``AdamW8bit`` does
(``torchao.optim.adam._AdamBase._new_buffer``, following bitsandbytes):

* ``adamw``: torch's AdamW keeps ``exp_avg`` and ``exp_avg_sq`` like the parameter (``zeros_like``): 2 x the
  parameter's element size (bf16 weights: 4 B per parameter; peft's float32 LoRA adapters: 8 B).
* ``adamw-bf16``: torchao's ``_AdamW`` keeps the same two states (``zeros_like``, no blocks): the same bytes.
* ``adamw8bit``: per quantized tensor two uint8 code tensors (1 B per element each), two float32 block scales
  per :data:`QUANT_BLOCK` elements and two 256-entry float32 code maps (``OptimState8bit.zeros``); smaller
  tensors keep the ``adamw`` states.
* ``adamw-cpu``: nothing on the GPU; on the host a pinned copy of each parameter and of its gradient (the
  staging of the update, in the parameter dtype) plus the two ``adamw`` states in pageable memory
  (:class:`oomb.train.optim.HostAdamW`).

The scalar ``step`` counters (a float32 scalar per tensor, on the CPU for torchao) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .shape import LORA_TARGETS, ModelShape, dtype_size

__all__ = ["OPTIMIZER_NAMES", "QUANT_BLOCK", "QUANT_MIN_NUMEL", "OptimizerBytes", "optimizer_bytes",
           "trainable_numels"]

OPTIMIZER_NAMES = ("adamw", "adamw8bit", "adamw-bf16", "adamw-cpu")
QUANT_BLOCK = 256
"""Elements per float32 scale of torchao's ``AdamW8bit`` (its default ``block_size``)."""
QUANT_MIN_NUMEL = 4096
"""Smallest tensor torchao's ``AdamW8bit`` quantizes (and then only when its size is a multiple of the block)."""
_QMAP_BYTES = 256 * 4  # one float32 code map per quantized state tensor


@dataclass(frozen=True)
class OptimizerBytes:
    """Bytes an optimizer keeps for its states: ``gpu`` on the GPU, ``host`` in host RAM (all of it),
    ``pinned`` the page-locked part of ``host``."""

    gpu: int
    host: int
    pinned: int


def trainable_numels(shape: ModelShape, lora_rank: int = 0, lora_targets=LORA_TARGETS,
                     train_embeddings_norms: bool = False) -> list[int]:
    """Elements of each trainable tensor: every parameter of the ``*ForCausalLM`` model (``lora_rank`` 0; their sum
    is :meth:`ModelShape.num_params`), or each LoRA A ``[r, in]`` and B ``[out, r]`` on the layers ``lora_targets``
    names (their sum is :meth:`ModelShape.lora_params`). See :func:`copied_numels` for what
    ``train_embeddings_norms`` adds."""
    h, i, q, kv, V, d = (shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim, shape.vocab_size,
                         shape.head_dim)
    r = lora_rank
    if r:
        dims = shape.linear_dims()
        layer = [n for t in shape.lora_targets(lora_targets) for n in (r * dims[t][0], dims[t][1] * r)]
        return layer * shape.num_layers
    layer = [h * q, h * kv, h * kv, q * h, h * i, h * i, i * h, h, h]
    if shape.qkv_bias:
        layer += [q, kv, kv]
    if shape.o_bias:
        layer += [h]
    if shape.mlp_bias:
        layer += [i, i, h]
    if shape.qk_norm:
        layer += [d, d]
    return [V * h] + layer * shape.num_layers + [h] + ([] if shape.tied_embeddings else [V * h])


def copied_numels(shape: ModelShape, lora_rank: int, train_embeddings_norms: bool) -> list[int]:
    """Elements of each trained copy LoRA with ``train_embeddings_norms`` adds (peft ``modules_to_save``, in the
    model dtype): the input embeddings and every norm (their sum is :meth:`ModelShape.embedding_norm_params`)."""
    if not (lora_rank and train_embeddings_norms):
        return []
    h, d = shape.hidden_size, shape.head_dim
    layer = [h, h] + ([d, d] if shape.qk_norm else [])
    return [shape.vocab_size * h] + layer * shape.num_layers + [h]


def _quantized(n: int) -> bool:
    return n >= QUANT_MIN_NUMEL and n % QUANT_BLOCK == 0


def optimizer_bytes(shape: ModelShape, dtype: torch.dtype, lora_rank: int, optimizer: str | None,
                    lora_targets=LORA_TARGETS, train_embeddings_norms: bool = False) -> OptimizerBytes:
    """The state bytes of ``optimizer`` (one of :data:`OPTIMIZER_NAMES`, or None: no optimizer) for the trainable
    tensors of ``shape`` in ``dtype`` (LoRA adapters on ``lora_targets``: float32, as peft keeps them; the copies
    ``train_embeddings_norms`` adds: ``dtype``).

    Raises:
        ValueError: an unknown optimizer name.
    """
    if optimizer is None:
        return OptimizerBytes(0, 0, 0)
    if optimizer not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_NAMES)}")
    # (elements, element size) of each trainable tensor
    tensors = [(k, 4 if lora_rank else dtype_size(dtype)) for k in trainable_numels(shape, lora_rank, lora_targets)]
    tensors += [(k, dtype_size(dtype)) for k in copied_numels(shape, lora_rank, train_embeddings_norms)]
    if optimizer in ("adamw", "adamw-bf16"):
        return OptimizerBytes(sum(2 * e * k for k, e in tensors), 0, 0)
    if optimizer == "adamw8bit":
        gpu = sum(2 * (k + 4 * (k // QUANT_BLOCK) + _QMAP_BYTES) if _quantized(k) else 2 * e * k for k, e in tensors)
        return OptimizerBytes(gpu, 0, 0)
    return OptimizerBytes(0, sum(4 * e * k for k, e in tensors), sum(2 * e * k for k, e in tensors))  # adamw-cpu
