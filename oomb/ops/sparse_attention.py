"""Page-level top-K sparse attention with gradients (docs/design.md §2.4): the autograd glue and the public function.

For long pasts each block of ``block_size`` queries (default 128) of a chunk attends, per KV head, only to a few
past pages plus its own chunk (causal). The pieces, each in its own module:

1. page summaries written in Stage 1: :mod:`oomb.ops.sparse_representatives`;
2. the top-K selection per (query block, KV head), made once per (chunk, layer):
   :mod:`oomb.ops.sparse_select`;
3. attention over the selection: the PyTorch reference :mod:`oomb.ops.sparse_attention_ref`, the Triton kernels
   :mod:`oomb.ops.triton.sparse_attention` (same contract), and here :func:`sparse_paged_attention` (autograd over
   either, same contract as :func:`oomb.ops.paged_attention.paged_attention`; a dense selection takes the dense
   path unchanged).

The engine's per-step state (representatives and stored selections) is
:class:`oomb.engine.sparse_state.SparseAttentionState`.
"""

from __future__ import annotations

import torch

from ..config.engine import KernelConfig
from .paged_attention import PagedKV, paged_attention, paged_attention_forward
from .sparse_attention_ref import sparse_attention_bwd_ref, sparse_attention_fwd_ref
from .sparse_select import PageSelection

__all__ = ["sparse_paged_attention", "sparse_paged_attention_forward"]


def _sparse_fwd(backend, q, k, v, kv: PagedKV, sel: PageSelection, scale, kernels: KernelConfig | None = None):
    args = (q, k, v, kv.k_cache, kv.v_cache, kv.block_table, kv.past_len, sel, scale, kv.q_doc_start)
    if backend == "triton":
        from .triton.sparse_attention import sparse_attention_fwd

        return sparse_attention_fwd(*args, kernels=kernels)
    return sparse_attention_fwd_ref(*args)


def _sparse_bwd(backend, dout, q, k, v, out, lse, kv: PagedKV, sel: PageSelection, scale,
                kernels: KernelConfig | None = None):
    args = (dout, q, k, v, out, lse, kv.k_cache, kv.v_cache, kv.block_table, kv.past_len, kv.dk_cache, kv.dv_cache, sel,
            scale, kv.q_doc_start)
    if backend == "triton":
        from .triton.sparse_attention import sparse_attention_bwd

        return sparse_attention_bwd(*args, kernels=kernels)
    return sparse_attention_bwd_ref(*args)


class _SparseAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kv: PagedKV, sel: PageSelection, scale: float, backend: str, saved: tuple | None,
                kernels: KernelConfig | None):
        out, lse = saved if saved is not None else _sparse_fwd(backend, q, k, v, kv, sel, scale, kernels)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kv, ctx.sel, ctx.scale, ctx.backend, ctx.kernels = kv, sel, scale, backend, kernels
        return out if saved is None else out.clone()

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kv: PagedKV = ctx.kv
        dq, dk, dv = _sparse_bwd(ctx.backend, dout.contiguous(), q, k, v, out, lse, kv, ctx.sel, ctx.scale, ctx.kernels)
        if kv.own_block_table is not None:  # what later chunks stored for this chunk's own K/V
            n = k.shape[0]
            idx = kv.own_block_table.long()
            dk = dk + kv.dk_cache.index_select(0, idx).flatten(0, 1)[:n].to(dk.dtype)
            dv = dv + kv.dv_cache.index_select(0, idx).flatten(0, 1)[:n].to(dv.dtype)
        if kv.after_backward is not None:
            kv.after_backward()
        return dq, dk, dv, None, None, None, None, None, None


def sparse_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    sel: PageSelection,
    softmax_scale: float,
    backend: str = "torch",
    block_size: int = 4096,
    saved: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    kernels: KernelConfig | None = None,
) -> torch.Tensor:
    """Differentiable attention of one chunk over its selected past pages plus its own K/V (causal).

    Same contract as :func:`oomb.ops.paged_attention.paged_attention` (dK/dV of the selected
    past pages are added into ``kv.dk_cache``/``kv.dv_cache`` in backward); a dense selection
    runs the dense path of ``backend`` unchanged; otherwise 'triton' runs
    :mod:`oomb.ops.triton.sparse_attention` and 'torch' the reference
    (:mod:`oomb.ops.sparse_attention_ref`). ``saved``: as in
    :func:`~oomb.ops.paged_attention.paged_attention` (the forward's earlier ``(out, lse)``).
    ``kernels``: the Triton kernels' settings (:class:`oomb.config.KernelConfig`; None: its defaults).

    Returns:
        out: [C, Hq, D] in q's dtype.
    """
    if sel.dense:
        return paged_attention(q, k, v, kv, softmax_scale, backend, block_size, saved, kernels=kernels)
    return _SparseAttentionFunction.apply(q, k, v, kv, sel, softmax_scale, backend, saved, kernels)


def sparse_paged_attention_forward(q, k, v, kv: PagedKV, sel: PageSelection, softmax_scale: float, backend="torch",
                                   block_size=4096, *, kernels: KernelConfig | None = None):
    """No-grad forward (Stage 1): (out [C, Hq, D], lse [Hq, C]); arguments as :func:`sparse_paged_attention`."""
    if sel.dense:
        return paged_attention_forward(q, k, v, kv, softmax_scale, backend, block_size, kernels=kernels)
    return _sparse_fwd(backend, q, k, v, kv, sel, softmax_scale, kernels)

