"""Paged attention with gradients: the autograd glue and the public function.

:func:`paged_attention` is what the engine calls for one (chunk, layer) in
Stage 2. Its forward computes attention of the chunk's queries over the past
pages plus the chunk's own K/V; its backward

* returns ``dq`` and the own chunk's ``dk``/``dv`` PLUS the gradient that later
  chunks already stored in the chunk's own gradient pages (so autograd carries
  it into the K/V projections below), and
* adds the past pages' dK/dV into the gradient pages in place, outside autograd
  (the past K/V are constants here and are never saved as activations).

Backends: ``"torch"`` (the reference in :mod:`oomb.ops.attention_ref`) and
``"triton"`` (:mod:`oomb.ops.triton_paged_attention`), which share one contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from .attention_ref import paged_attention_bwd_ref, paged_attention_fwd_ref

__all__ = ["PagedKV", "paged_attention", "paged_attention_forward", "resolve_backend"]


@dataclass
class PagedKV:
    """The paged state one (chunk, layer) attention reads and writes.

    Attributes:
        k_cache, v_cache: [P, S, Hkv, D] page pools (model dtype).
        dk_cache, dv_cache: [P, S, Hkv, D] gradient pools (float32/float64), or None in Stage 1.
        block_table: int32 [n_past_pages] page ids of the past tokens of this layer.
        past_len: number of past tokens.
        own_block_table: int32 [n_own_pages] pages holding the chunk's own stored gradient,
            or None when no later chunk can have written one (the last chunk).
        q_doc_start: int32 [C] absolute index of each query's document start for packed
            sequences (see :func:`oomb.ops.attention_ref.paged_attention_fwd_ref`), or None.
        after_backward: called once the backward has written the past dK/dV and read the own
            stored gradient (a store that keeps pages in host memory writes them back here).
    """

    k_cache: torch.Tensor | None
    v_cache: torch.Tensor | None
    block_table: torch.Tensor | None
    past_len: int
    dk_cache: torch.Tensor | None = None
    dv_cache: torch.Tensor | None = None
    own_block_table: torch.Tensor | None = None
    q_doc_start: torch.Tensor | None = None
    after_backward: Callable[[], None] | None = None


@lru_cache(maxsize=None)
def _triton_available() -> bool:
    try:
        from . import triton_paged_attention  # noqa: F401
    except Exception:  # pragma: no cover - depends on the installation
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA when the kernels import, else 'torch'.

    Raises:
        ValueError: for 'triton' when triton or the kernels cannot be imported.
    """
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if backend == "triton" and not _triton_available():
        raise ValueError(
            "attention_backend='triton' needs the Triton kernels (pip install 'oomb[triton]'); "
            "use attention_backend='torch' for the PyTorch path"
        )
    return backend


def _doc_kwargs(kv: PagedKV) -> dict:
    # Only packed sequences pass the argument, so kernels without packing support still serve the rest.
    return {} if kv.q_doc_start is None else {"q_doc_start": kv.q_doc_start}


def _fwd(backend: str, q, k, v, kv: PagedKV, scale: float, block_size: int):
    if backend == "triton":
        from .triton_paged_attention import paged_attention_fwd

        return paged_attention_fwd(
            q, k, v, kv.k_cache, kv.v_cache, kv.block_table, kv.past_len, softmax_scale=scale, **_doc_kwargs(kv)
        )
    return paged_attention_fwd_ref(
        q, k, v, kv.k_cache, kv.v_cache, kv.block_table, kv.past_len, scale, block_size, kv.q_doc_start
    )


def _bwd(backend: str, dout, q, k, v, out, lse, kv: PagedKV, scale: float, block_size: int):
    args = (dout, q, k, v, out, lse, kv.k_cache, kv.v_cache, kv.block_table, kv.past_len, kv.dk_cache, kv.dv_cache)
    if backend == "triton":
        from .triton_paged_attention import paged_attention_bwd

        return paged_attention_bwd(*args, softmax_scale=scale, **_doc_kwargs(kv))
    return paged_attention_bwd_ref(*args, scale, block_size, kv.q_doc_start)


class _PagedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kv: PagedKV, scale: float, backend: str, block_size: int):
        out, lse = _fwd(backend, q, k, v, kv, scale, block_size)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kv, ctx.scale, ctx.backend, ctx.block_size = kv, scale, backend, block_size
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kv: PagedKV = ctx.kv
        dq, dk, dv = _bwd(ctx.backend, dout.contiguous(), q, k, v, out, lse, kv, ctx.scale, ctx.block_size)
        if kv.own_block_table is not None:
            n = k.shape[0]
            idx = kv.own_block_table.long()
            dk = dk + kv.dk_cache.index_select(0, idx).flatten(0, 1)[:n].to(dk.dtype)
            dv = dv + kv.dv_cache.index_select(0, idx).flatten(0, 1)[:n].to(dv.dtype)
        if kv.after_backward is not None:
            kv.after_backward()
        return dq, dk, dv, None, None, None, None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    softmax_scale: float,
    backend: str = "torch",
    block_size: int = 4096,
) -> torch.Tensor:
    """Differentiable attention of one chunk over paged past K/V plus its own K/V (causal).

    Args:
        q: [C, Hq, D]; k, v: [C, Hkv, D] (the chunk's own, with autograd history).
        kv: the paged state (see :class:`PagedKV`); its gradient pools are written in backward.
        softmax_scale: multiplier of q·k.
        backend: 'torch' or 'triton' (already resolved, see :func:`resolve_backend`).
        block_size: past tokens per block of the torch reference.

    Returns:
        out: [C, Hq, D] in q's dtype.
    """
    return _PagedAttentionFunction.apply(q, k, v, kv, softmax_scale, backend, block_size)


def paged_attention_forward(q, k, v, kv: PagedKV, softmax_scale: float, backend: str = "torch", block_size: int = 4096):
    """No-grad forward (Stage 1): returns (out [C, Hq, D], lse [Hq, C] float32)."""
    return _fwd(backend, q, k, v, kv, softmax_scale, block_size)
