"""Paged attention with gradients: the autograd glue and the public function.

:func:`paged_attention` is what the engine calls for one (chunk, layer) in
Stage 2. Its forward computes attention of the chunk's queries over the past
pages plus the chunk's own K/V; its backward

* returns ``dq`` and the own chunk's ``dk``/``dv`` PLUS the gradient that later
  chunks already stored in the chunk's own gradient pages (so autograd carries
  it into the K/V projections below), and
* adds the past pages' dK/dV into the gradient pages in place, outside autograd
  (the past K/V are constants here and are never saved as activations).

Backends, which share one contract: ``"torch"`` (the reference in
:mod:`oomb.ops.attention_ref`), ``"triton"`` (the paged kernels,
:mod:`oomb.ops.triton.paged_attention`), and ``"sdpa"``: PyTorch's fused cuDNN
attention (:mod:`oomb.ops.sdpa_attention`; on the CPU its flash kernel) for every call
whose past lies in a few runs of consecutive pool pages (``PagedKV.past_runs`` set; with
a segmented past, per segment: ``PastSegments.runs``) and has no packed-document mask,
the paged kernels (Triton on CUDA, else the reference) for the
rest -- and for all calls while ``torch.use_deterministic_algorithms(True)`` is on, since
cuDNN's attention backward is not deterministic.

**Segmented past.** A store that cannot show a layer's whole past through one block
table (:class:`oomb.engine.offload.OffloadedKVStore` stages it into a few fixed
buffers) sets :attr:`PagedKV.segments`. The forward then runs one call per segment
``[a, b)`` of past tokens (``past_start=a``, ``past_len=b``; the chunk's own keys go with
the LAST segment, whose ``past_len`` is the whole past, so own token ``i`` keeps its
absolute index for packed-document masks) and merges the parts in float32 (float64 for
float64 inputs) with the log-sum-exp rule::

    lse = logaddexp_s lse_s        out = sum_s exp(lse_s - lse) * out_s

(a part in which a row sees no key has ``lse_s = -inf`` and weight 0). The backward runs
the segments in reverse with the FINAL out and lse, so each call yields that segment's
exact share: its dq (summed in float32) and its past dK/dV (added to its gradient pages
before the store writes them back). With a single segment the calls are exactly the
unsegmented ones, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Protocol, Sequence

import torch

from ..config.engine import KernelConfig
from .attention_ref import paged_attention_bwd_ref, paged_attention_fwd_ref

__all__ = ["PagedKV", "PastSegments", "paged_attention", "paged_attention_forward", "paged_backend", "resolve_backend"]


class PastSegments(Protocol):
    """The past of one (chunk, layer) attention, shown one segment at a time (see the module docstring).

    Attributes:
        bounds: token ranges ``[(a_0, b_0), (a_1, b_1), ...]`` in order, ``a_0 = 0``,
            ``a_{s+1} = b_s``, the last ``b`` = ``past_len``; empty when there is no past.
    """

    bounds: Sequence[tuple[int, int]]

    def acquire(self, index: int, grad: bool) -> tuple:
        """Make segment ``index`` readable by the next kernels (waits on the compute stream).

        Returns ``(k_cache, v_cache, block_table, dk_cache, dv_cache)``: pools and an int32
        table whose entries ``[a // S, ceil(b / S))`` address the segment's pages (earlier
        entries are never read); the gradient pools are None unless ``grad``.
        """

    def runs(self, index: int, grad: bool) -> tuple[tuple, tuple]:
        """Segment ``index`` (acquired) as contiguous views, for the ``'sdpa'`` backend.

        Returns ``(kv_runs, grad_runs)``: ``(k, v)`` views of [n_r, Hkv, D] in token order covering the segment's
        tokens ``[a, b)``, and with ``grad`` the ``(dk, dv)`` views of the same pages (else ``()``); ``((), ())``
        where the segment does not lie in a few runs (its calls then read the block table).
        """

    def release(self, index: int, grad: bool) -> None:
        """The kernels reading (and, with ``grad``, adding into) segment ``index`` are enqueued."""

    def begin_backward(self) -> None:
        """The backward of this view starts (before its first segment)."""

    def own_grad(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The dK/dV later chunks stored for the chunk's own ``n`` tokens ([n, Hkv, D] each), or None."""


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
        segments: None (the whole past through ``block_table``), or the past in segments
            (:class:`PastSegments`); then k_cache, v_cache, block_table, dk_cache, dv_cache and
            own_block_table are unused (None) and ``segments.own_grad`` gives the own stored gradient.
        past_runs: the same past K/V where it lies in a few runs of consecutive pool pages: ``(k, v)`` views of
            [n_r, Hkv, D] in token order, their lengths summing to ``past_len`` (the ``'sdpa'`` backend reads
            these); ``()`` otherwise.
        past_grad_runs: ``(dk, dv)`` views of the gradient pages of the same runs (Stage 2), else ``()``.
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
    segments: PastSegments | None = None
    past_runs: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    past_grad_runs: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()


@lru_cache(maxsize=None)
def _triton_available() -> bool:
    try:
        from .triton import paged_attention  # noqa: F401
    except Exception:  # pragma: no cover - depends on the installation
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' -> 'sdpa' on CUDA (cuDNN where a call allows it, else the Triton kernels if they
    import, else the reference), 'torch' on the CPU. Other names are returned as they are.

    Raises:
        ValueError: for 'triton' when triton or the kernels cannot be imported.
    """
    if backend == "auto":
        return "sdpa" if device.type == "cuda" else "torch"
    if backend == "triton" and not _triton_available():
        raise ValueError(
            "attention_backend='triton' needs the Triton kernels (pip install 'oomb[triton]'); "
            "use attention_backend='torch' for the PyTorch path"
        )
    return backend


def paged_backend(backend: str, device: torch.device) -> str:
    """The block-table backend behind ``backend``: 'sdpa' -> 'triton' on CUDA when the kernels import,
    else 'torch'; 'torch' and 'triton' unchanged. (Calls and ops that need a block table: sparse
    attention, a segmented or scattered past, packed documents.)"""
    if backend != "sdpa":
        return backend
    return "triton" if device.type == "cuda" and _triton_available() else "torch"


def step_backend(config, device: torch.device) -> str:
    """The backend a step with ``config`` (an :class:`oomb.OOMBConfig`) runs its attention on, for sizing its
    memory: :func:`resolve_backend` of ``config.attention_backend``, and with ``config.sparse`` the block-table
    backend behind it (:func:`paged_backend`: sparse attention reads its selected pages through the block table).

    Raises:
        ValueError: as :func:`resolve_backend`.
    """
    backend = resolve_backend(config.attention_backend, device)
    return paged_backend(backend, device) if config.sparse else backend


def _sdpa_serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV, grad: bool) -> bool:
    """Whether the 'sdpa' backend runs this call (or segment) through :mod:`oomb.ops.sdpa_attention`."""
    from .sdpa_attention import sdpa_available

    if kv.q_doc_start is not None or (q.is_cuda and torch.are_deterministic_algorithms_enabled()):
        return False
    if kv.past_len and (not kv.past_runs or (grad and not kv.past_grad_runs)):
        return False
    if k.dtype != q.dtype or v.dtype != q.dtype or any(pk.dtype != q.dtype for pk, _ in kv.past_runs):
        return False  # mixed dtypes (autocast: bf16 projections, float32 RoPE or store): the paged path reads them
    return sdpa_available(q)


def _doc_kwargs(kv: PagedKV) -> dict:
    # Only packed sequences pass the argument, so kernels without packing support still serve the rest.
    return {} if kv.q_doc_start is None else {"q_doc_start": kv.q_doc_start}


def _part_kwargs(part: tuple | None, dtype_name: str) -> dict:
    """Keyword arguments of one segment call ``part = (past_start, include_own, out/dq dtype or None)``;
    none for an unsegmented call (``part`` None), which so stays exactly the call it always was."""
    if part is None:
        return {}
    past_start, include_own, dtype = part
    kw = {"past_start": past_start, "include_own": include_own}
    if dtype is not None:
        kw[dtype_name] = dtype
    return kw


def _sdpa_kwargs(part: tuple | None, dtype_name: str) -> dict:
    """:mod:`oomb.ops.sdpa_attention` keywords of one segment call: :func:`_part_kwargs` less ``past_start``,
    which the segment's runs imply."""
    kw = _part_kwargs(part, dtype_name)
    kw.pop("past_start", None)
    return kw


def _fwd(backend: str, q, k, v, kv: PagedKV, scale: float, block_size: int, part: tuple | None = None,
         kernels: KernelConfig | None = None):
    if backend == "sdpa":
        if _sdpa_serves(q, k, v, kv, False):
            from .sdpa_attention import sdpa_attention_fwd

            return sdpa_attention_fwd(q, k, v, kv.past_runs, scale, **_sdpa_kwargs(part, "out_dtype"))
        backend = paged_backend(backend, q.device)
    kw = _part_kwargs(part, "out_dtype")
    if backend == "triton":
        from .triton.paged_attention import paged_attention_fwd

        return paged_attention_fwd(
            q, k, v, kv.k_cache, kv.v_cache, kv.block_table, kv.past_len, softmax_scale=scale, **_doc_kwargs(kv), **kw,
            kernels=kernels,
        )
    return paged_attention_fwd_ref(
        q, k, v, kv.k_cache, kv.v_cache, kv.block_table, kv.past_len, scale, block_size, kv.q_doc_start, **kw
    )


def _bwd(backend: str, dout, q, k, v, out, lse, kv: PagedKV, scale: float, block_size: int, part: tuple | None = None,
         delta: torch.Tensor | None = None, kernels: KernelConfig | None = None):
    if backend == "sdpa":
        if _sdpa_serves(q, k, v, kv, True):
            from .sdpa_attention import sdpa_attention_bwd

            return sdpa_attention_bwd(dout, q, k, v, out, lse, kv.past_runs, kv.past_grad_runs, scale,
                                      **_sdpa_kwargs(part, "dq_dtype"))
        backend = paged_backend(backend, q.device)
    args = (dout, q, k, v, out, lse, kv.k_cache, kv.v_cache, kv.block_table, kv.past_len, kv.dk_cache, kv.dv_cache)
    kw = _part_kwargs(part, "dq_dtype")
    if backend == "triton":
        from .triton.paged_attention import paged_attention_bwd

        if delta is not None:
            kw["delta"] = delta
        return paged_attention_bwd(*args, softmax_scale=scale, **_doc_kwargs(kv), **kw, kernels=kernels)
    return paged_attention_bwd_ref(*args, scale, block_size, kv.q_doc_start, **kw)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _segment_view(kv: PagedKV, index: int, grad: bool) -> PagedKV:
    """Acquire segment ``index`` and return the PagedKV of one call over it."""
    kc, vc, bt, dkc, dvc = kv.segments.acquire(index, grad)
    runs, grad_runs = kv.segments.runs(index, grad)
    return PagedKV(kc, vc, bt, kv.segments.bounds[index][1], dkc, dvc, q_doc_start=kv.q_doc_start, past_runs=runs,
                   past_grad_runs=grad_runs)


def _fwd_segmented(backend: str, q, k, v, kv: PagedKV, scale: float, block_size: int,
                   kernels: KernelConfig | None = None):
    """Forward over the segments of ``kv.segments`` merged by log-sum-exp -> (out in q's dtype, lse [Hq, C]).
    With ``backend='sdpa'`` each segment that shows contiguous runs goes through cuDNN, the others through the
    block table."""
    bounds = list(kv.segments.bounds)
    if not bounds:  # no past: the own chunk alone
        return _fwd(backend, q, k, v, PagedKV(None, None, None, 0, q_doc_start=kv.q_doc_start), scale, block_size,
                    kernels=kernels)
    n = len(bounds)
    acc = None if n == 1 else _acc_dtype(q.dtype)
    out = lse = lse_dtype = None
    for i, (a, _) in enumerate(bounds):
        part_kv = _segment_view(kv, i, False)
        o, l = _fwd(backend, q, k, v, part_kv, scale, block_size, (a, i == n - 1, acc), kernels)
        kv.segments.release(i, False)
        if n == 1:
            return o, l
        lse_dtype = l.dtype
        l = l.to(acc)
        if out is None:
            out, lse = o, l
            continue
        new = torch.logaddexp(lse, l)
        ref = torch.where(torch.isinf(new), 0.0, new)  # a row that saw nothing yet: weights exp(-inf) = 0
        out = out * torch.exp(lse - ref).t()[..., None] + o * torch.exp(l - ref).t()[..., None]
        lse = new
    return out.to(q.dtype), lse.to(lse_dtype)


def _bwd_segmented(backend: str, dout, q, k, v, out, lse, kv: PagedKV, scale: float, block_size: int,
                   kernels: KernelConfig | None = None):
    """Backward over the segments in reverse -> (dq, dk, dv) of the own chunk (dK/dV of the past added in place)."""
    seg = kv.segments
    bounds = list(seg.bounds)
    seg.begin_backward()
    if not bounds:
        return _bwd(backend, dout, q, k, v, out, lse, PagedKV(None, None, None, 0, q_doc_start=kv.q_doc_start), scale,
                    block_size, kernels=kernels)
    n = len(bounds)
    acc = None if n == 1 else _acc_dtype(q.dtype)
    delta = None
    dq = dk = dv = None
    for i in range(n - 1, -1, -1):
        part_kv = _segment_view(kv, i, True)
        call = backend
        if backend != "sdpa" or not _sdpa_serves(q, k, v, part_kv, True):
            call = paged_backend(backend, q.device)
            if call == "triton" and n > 1 and delta is None:  # rowsum(dout * out), once for the Triton segments
                from .triton.inputs import _delta

                delta = _delta(dout, out)
        dq_i, dk_i, dv_i = _bwd(call, dout, q, k, v, out, lse, part_kv, scale, block_size,
                                (bounds[i][0], i == n - 1, acc), delta, kernels)
        seg.release(i, True)
        dq = dq_i if dq is None else dq + dq_i
        if i == n - 1:
            dk, dv = dk_i, dv_i
    return dq.to(q.dtype), dk, dv


class _PagedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kv: PagedKV, scale: float, backend: str, block_size: int, saved: tuple | None,
                kernels: KernelConfig | None):
        if saved is not None:  # this forward's (out, lse) computed earlier on the same inputs (save_attention)
            out, lse = saved
        else:
            fwd = _fwd if kv.segments is None else _fwd_segmented
            out, lse = fwd(backend, q, k, v, kv, scale, block_size, kernels=kernels)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kv, ctx.scale, ctx.backend, ctx.block_size, ctx.kernels = kv, scale, backend, block_size, kernels
        return out if saved is None else out.clone()

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kv: PagedKV = ctx.kv
        bwd = _bwd if kv.segments is None else _bwd_segmented
        dq, dk, dv = bwd(ctx.backend, dout.contiguous(), q, k, v, out, lse, kv, ctx.scale, ctx.block_size,
                         kernels=ctx.kernels)
        if kv.segments is not None:
            own = kv.segments.own_grad(k.shape[0])
            if own is not None:
                dk = dk + own[0].to(dk.dtype)
                dv = dv + own[1].to(dv.dtype)
        elif kv.own_block_table is not None:
            n = k.shape[0]
            idx = kv.own_block_table.long()
            dk = dk + kv.dk_cache.index_select(0, idx).flatten(0, 1)[:n].to(dk.dtype)
            dv = dv + kv.dv_cache.index_select(0, idx).flatten(0, 1)[:n].to(dv.dtype)
        if kv.after_backward is not None:
            kv.after_backward()
        return dq, dk, dv, None, None, None, None, None, None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    softmax_scale: float,
    backend: str = "torch",
    block_size: int = 4096,
    saved: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    kernels: KernelConfig | None = None,
) -> torch.Tensor:
    """Differentiable attention of one chunk over paged past K/V plus its own K/V (causal).

    Args:
        q: [C, Hq, D]; k, v: [C, Hkv, D] (the chunk's own, with autograd history).
        kv: the paged state (see :class:`PagedKV`); its gradient pools are written in backward.
        softmax_scale: multiplier of q·k.
        backend: 'torch', 'triton' or 'sdpa' (already resolved, see :func:`resolve_backend`).
        block_size: past tokens per block of the torch reference.
        saved: ``(out, lse)`` this same forward returned earlier for bitwise the same inputs (the engine's
            ``save_attention``: Stage 1's outputs, reused by the Stage-2 recompute; ``checkpoint_attention``: the
            chunk's first Stage-2 forward's, reused by the rerun of a checkpointed layer). The forward is then
            skipped and the backward uses them; None computes them.
        kernels: settings of the Triton kernels (:class:`oomb.config.KernelConfig`: autotune, tensor
            descriptors); None: its defaults. Unused by the other backends.

    Returns:
        out: [C, Hq, D] in q's dtype.
    """
    return _PagedAttentionFunction.apply(q, k, v, kv, softmax_scale, backend, block_size, saved, kernels)


def paged_attention_forward(q, k, v, kv: PagedKV, softmax_scale: float, backend: str = "torch", block_size: int = 4096,
                            *, kernels: KernelConfig | None = None):
    """No-grad forward (Stage 1): returns (out [C, Hq, D], lse [Hq, C] float32; float64 from the
    torch backend for float64 inputs). Segmented like :func:`paged_attention` when ``kv.segments`` is set;
    ``kernels`` as there."""
    fwd = _fwd if kv.segments is None else _fwd_segmented
    return fwd(backend, q, k, v, kv, softmax_scale, block_size, kernels=kernels)
