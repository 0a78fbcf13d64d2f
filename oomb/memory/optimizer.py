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

from .shape import ModelShape, dtype_size

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


def trainable_numels(shape: ModelShape, lora_rank: int = 0) -> list[int]:
    """Elements of each trainable tensor: every parameter of the ``*ForCausalLM`` model (``lora_rank`` 0; their sum
    is :meth:`ModelShape.num_params`), or each LoRA A ``[r, in]`` and B ``[out, r]`` on q/k/v/o (their sum is
    :meth:`ModelShape.lora_params`)."""
    h, i, q, kv, V, d = (shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim, shape.vocab_size,
                         shape.head_dim)
    r = lora_rank
    if r:
        layer = [r * h, q * r, r * h, kv * r, r * h, kv * r, r * q, h * r]
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


def _quantized(n: int) -> bool:
    return n >= QUANT_MIN_NUMEL and n % QUANT_BLOCK == 0


def optimizer_bytes(shape: ModelShape, dtype: torch.dtype, lora_rank: int, optimizer: str | None) -> OptimizerBytes:
    """The state bytes of ``optimizer`` (one of :data:`OPTIMIZER_NAMES`, or None: no optimizer) for the trainable
    tensors of ``shape`` in ``dtype`` (LoRA adapters: float32, as peft keeps them).

    Raises:
        ValueError: an unknown optimizer name.
    """
    if optimizer is None:
        return OptimizerBytes(0, 0, 0)
    if optimizer not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_NAMES)}")
    numels = trainable_numels(shape, lora_rank)
    e = 4 if lora_rank else dtype_size(dtype)  # the trainable tensors' element size
    n = sum(numels)
    if optimizer in ("adamw", "adamw-bf16"):
        return OptimizerBytes(2 * e * n, 0, 0)
    if optimizer == "adamw8bit":
        gpu = sum(2 * (k + 4 * (k // QUANT_BLOCK) + _QMAP_BYTES) if _quantized(k) else 2 * e * k for k in numels)
        return OptimizerBytes(gpu, 0, 0)
    return OptimizerBytes(0, 4 * e * n, 2 * e * n)  # adamw-cpu
