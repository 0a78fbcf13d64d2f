"""One Stage-2 chunk's attention outputs, kept across the per-layer checkpoints (``OOMBConfig.checkpoint_attention``).

With ``checkpoint_layers`` every decoder layer of the Stage-2 recompute runs under activation checkpointing
(``torch.utils.checkpoint``, non-reentrant): its forward keeps only the layer's input, and right before the
layer's backward the checkpoint runs the layer's forward once more to rebuild what the backward reads. That
second forward would run the attention over the whole past again, on bitwise the same q, k, v. Instead the
first forward's ``out`` [C, Hq, D] and ``lse`` [Hq, C] of each layer are kept here, and the rerun hands them
to the attention's autograd Function as its ``saved`` outputs (as :mod:`oomb.engine.saved_attention` does for
Stage 1's), so the attention forward runs once per (chunk, layer) in Stage 2 instead of twice. The
gradients are those of the rerun: the backward reads bitwise the out and lse it would have recomputed.

This is selective activation checkpointing as torchtitan's "op" policy does it: keep the attention op's
outputs, recompute the cheap rest. It costs one chunk's outputs over all layers, ``L x C x Hq x (D x e + 4)``
bytes (e = model dtype size; lse in float32): 0.78 GiB for the Qwen2.5-7B shape at chunk 4096 in bf16: as
much again as the layer inputs the checkpoints keep, 3% of a chunk's saved activations without
checkpointing (24.3 GiB; :func:`oomb.memory.activation_bytes` counts it). Each layer's pair is dropped when its rerun
takes it, so the bytes go down over the chunk's backward.
"""

from __future__ import annotations

import torch

__all__ = ["KeptAttention"]


class KeptAttention:
    """The ``(out, lse)`` of each layer of the Stage-2 chunk now running, from its first forward to its rerun."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(self, start: int, layer: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Keep the attention output ``out`` [C, Hq, D] and ``lse`` [Hq, C] of (chunk at token ``start``, ``layer``)."""
        self._kept[(start, layer)] = (out.detach(), lse.detach())

    def take(self, start: int, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pair kept for (chunk at token ``start``, ``layer``), forgotten here; None if none is kept
        (the chunk's first forward of that layer)."""
        return self._kept.pop((start, layer), None)

    def clear(self) -> None:
        """Forget everything (a chunk's backward is done, or the step ended)."""
        self._kept.clear()

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors kept now."""
        return sum(t.numel() * t.element_size() for pair in self._kept.values() for t in pair)
