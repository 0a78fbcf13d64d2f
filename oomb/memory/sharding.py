"""One rank's bytes of weights, gradients and optimizer states under FSDP2 sharding, and the bytes it all-gathers
and reduce-scatters per step (``train.shard``; :mod:`oomb.engine.sharding`; docs/design.md §8).

FSDP2 shards per unit: each decoder layer is one, the root (input embeddings, final norm, output head) another.
With W ranks (``nproc``), per rank:

=================  ==============================================  ================================================
                   ``params`` (ZeRO-3-like)                        ``grads-optim`` (ZeRO-2-like)
=================  ==============================================  ================================================
weights            all / W + gathered: the root + 3 layers (the    all / W + all (gathered for the whole step)
                   last, kept; the next in backward order,
                   prefetched; one all-gather buffer)
gradients          trainable / W (float32 with ``grad_accum_dtype  trainable: the step's unsharded sums (float32
                   float32``) + the root's and two layers'         with ``grad_accum_dtype float32``); their 1/W
                   unsharded (the layer in its backward and its    shard replaces them at the step's last backward,
                   reduce-scatter buffer)                          after the peak
optimizer states   / W                                             / W
=================  ==============================================  ================================================

"trainable" are the trainable parameters' bytes (a LoRA adapter's float32); "all" every parameter's (frozen base
weights are sharded and gathered too). The gathered and unsharded extras are estimates of FSDP2's buffers at a
chunk's peak (the start of its backward), not yet measured on a GPU.

Collectives per optimizer step of K sequences per rank of N chunks each (``unit`` bytes: a unit's weights in the
model dtype; each rank receives (W - 1) / W of an all-gather and sends as much of a reduce-scatter):

* ``params``: a middle layer is gathered for each use, K (3N - 1) times (Stage 1's N - 1 forwards, Stage 2's N
  forwards and N backwards); the first layer K (2N - 1) + 1 times (it stays gathered from a chunk's backward into
  the next chunk's forward); the last layer and the root once. Every unit's gradients are reduce-scattered after
  every chunk's backward: K N times.
* ``grads-optim``: every unit gathered once, its gradients reduce-scattered once.
* ``none``: one all-reduce of the trainable gradients.

:func:`collective_counts` gives these counts; the CPU tests count FSDP2's collectives and compare.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.job import SHARDS as SHARD_MODES
from .optimizer import copied_numels, optimizer_bytes, trainable_numels
from .shape import LORA_TARGETS, ModelShape, dtype_size

__all__ = ["SHARD_MODES", "ShardBytes", "UnitBytes", "collective_counts", "shard_bytes", "shard_traffic", "unit_bytes"]



@dataclass(frozen=True)
class UnitBytes:
    """Bytes of FSDP2's units of a model: the root (embeddings, final norm, output head) and one decoder layer.

    ``*_weights``: every parameter (frozen included) in its dtype; ``*_trainable``: the trainable parameters'
    (their gradients' bytes); ``*_trainable_numel``: their elements.
    """

    root_weights: int
    layer_weights: int
    root_trainable: int
    layer_trainable: int
    root_trainable_numel: int
    layer_trainable_numel: int
    num_layers: int

    @property
    def weights(self) -> int:
        return self.root_weights + self.num_layers * self.layer_weights

    @property
    def trainable(self) -> int:
        return self.root_trainable + self.num_layers * self.layer_trainable

    @property
    def trainable_numel(self) -> int:
        return self.root_trainable_numel + self.num_layers * self.layer_trainable_numel


def unit_bytes(shape: ModelShape, dtype: torch.dtype, lora_rank: int = 0, lora_targets=LORA_TARGETS,
               train_embeddings_norms: bool = False) -> UnitBytes:
    """The :class:`UnitBytes` of ``shape`` in ``dtype`` (LoRA adapters float32, as peft keeps them; the copies
    ``train_embeddings_norms`` adds in ``dtype``)."""
    e, L, h, V = dtype_size(dtype), shape.num_layers, shape.hidden_size, shape.vocab_size
    root_base = V * h * (1 if shape.tied_embeddings else 2) + h
    layer_base = (shape.num_params() - root_base) // L
    if not lora_rank:
        return UnitBytes(root_base * e, layer_base * e, root_base * e, layer_base * e, root_base, layer_base, L)
    adapter = sum(trainable_numels(shape, lora_rank, lora_targets)) // L
    copies = copied_numels(shape, lora_rank, train_embeddings_norms)
    root_copies = (V * h + h) if copies else 0  # the embeddings' and the final norm's copies
    layer_copies = (sum(copies) - root_copies) // L if copies else 0
    return UnitBytes(root_base * e + root_copies * e, layer_base * e + adapter * 4 + layer_copies * e,
                     root_copies * e, adapter * 4 + layer_copies * e, root_copies, adapter + layer_copies, L)


@dataclass(frozen=True)
class ShardBytes:
    """One rank's GPU bytes of weights, gradients and optimizer states (:func:`shard_bytes`); ``gathered`` is the
    part of ``weights`` held unsharded at a chunk's peak, ``grad_buffers`` the part of ``grads`` held unsharded
    there."""

    weights: int
    grads: int
    optimizer: int
    gathered: int
    grad_buffers: int


def shard_bytes(shape: ModelShape, dtype: torch.dtype, shard: str, nproc: int, lora_rank: int = 0,
                lora_targets=LORA_TARGETS, train_embeddings_norms: bool = False, optimizer: str | None = "adamw",
                grad_accum_dtype: str = "param") -> ShardBytes:
    """One rank's weights, gradients and optimizer states under ``shard`` over ``nproc`` ranks (module docstring).

    ``shard`` 'none' (or one rank): the whole model's, as one process. ``optimizer``: its GPU states
    (:func:`~oomb.memory.optimizer.optimizer_bytes`; None: none), divided over the ranks when sharded.

    Raises:
        ValueError: an unknown ``shard`` or ``nproc`` < 1.
    """
    if shard not in SHARD_MODES:
        raise ValueError(f"unknown shard mode {shard!r}; use one of {', '.join(SHARD_MODES)}")
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    u = unit_bytes(shape, dtype, lora_rank, lora_targets, train_embeddings_norms)
    e = dtype_size(dtype)
    f32 = grad_accum_dtype == "float32" and e < 4 and not lora_rank  # float32 sums of bf16/fp16 gradients
    grad = u.trainable_numel * 4 if f32 else u.trainable  # a whole gradient (or its float32 sums)
    optim = optimizer_bytes(shape, dtype, lora_rank, optimizer, lora_targets, train_embeddings_norms).gpu
    W = nproc
    if shard == "none" or W == 1:
        return ShardBytes(u.weights, grad, optim, 0, 0)
    if shard == "grads-optim":
        return ShardBytes(u.weights // W + u.weights, grad, optim // W, u.weights, grad)
    gathered = u.root_weights + min(u.num_layers, 3) * u.layer_weights
    reduce = 4 * u.layer_trainable_numel if grad_accum_dtype == "float32" else u.layer_trainable
    buffers = u.root_trainable + u.layer_trainable + reduce
    return ShardBytes(u.weights // W + gathered, grad // W + buffers, optim // W, gathered, buffers)


def collective_counts(shard: str, num_layers: int, chunks: int, sequences: int = 1) -> dict[str, int]:
    """How many times per optimizer step (``sequences`` per rank of ``chunks`` chunks) each unit is all-gathered
    and reduce-scattered: ``{"root", "first", "middle" (each middle layer), "last"}`` gathers and
    ``"reduce_scatter"`` (per unit). A one-layer model's layer counts as ``"last"``. Zeros for 'none'."""
    K, N, L = sequences, chunks, num_layers
    if shard == "none":
        return {"root": 0, "first": 0, "middle": 0, "last": 0, "reduce_scatter": 0}
    if shard == "grads-optim":
        return {"root": 1, "first": 1 if L > 1 else 0, "middle": 1, "last": 1, "reduce_scatter": 1}
    return {"root": 1, "first": K * (2 * N - 1) + 1 if L > 1 else 0, "middle": K * (3 * N - 1), "last": 1,
            "reduce_scatter": K * N}


def shard_traffic(shape: ModelShape, dtype: torch.dtype, shard: str, nproc: int, seq_len: int, chunk_size: int,
                  sequences: int = 1, lora_rank: int = 0, lora_targets=LORA_TARGETS, train_embeddings_norms: bool = False,
                  grad_accum_dtype: str = "param") -> dict[str, int]:
    """Bytes one optimizer step moves through collectives (``sequences`` per rank of ``seq_len`` tokens in chunks of
    ``chunk_size``): ``{"all_gather", "reduce_scatter", "all_reduce"}``, each the unsharded bytes of the tensors
    (a rank receives or sends (W - 1) / W of an all-gather or reduce-scatter, twice that of a ring all-reduce).
    Zeros for one rank."""
    if nproc == 1:
        return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    u = unit_bytes(shape, dtype, lora_rank, lora_targets, train_embeddings_norms)
    reduce_size = 4 if grad_accum_dtype == "float32" else None
    trainable = u.trainable_numel * reduce_size if reduce_size else u.trainable
    if shard == "none":
        return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": trainable}
    n = collective_counts(shard, u.num_layers, -(-seq_len // chunk_size), sequences)
    middle = max(u.num_layers - 2, 0)
    gathers = (n["root"] * u.root_weights + (n["first"] + n["middle"] * middle + n["last"]) * u.layer_weights)
    return {"all_gather": gathers, "reduce_scatter": n["reduce_scatter"] * trainable, "all_reduce": 0}
