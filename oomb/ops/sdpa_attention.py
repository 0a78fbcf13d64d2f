"""Chunk attention through PyTorch's fused SDPA kernels, for a past held in a few contiguous runs.

Same contract as :mod:`oomb.ops.attention_ref` for the calls it serves: one chunk of ``C``
queries over ``past_len`` earlier tokens plus its own ``C`` tokens, causal inside the chunk;
the backward adds the past dK/dV into float32 gradient storage in place and returns the own
chunk's dk/dv. It serves a past that lies in memory as a few ``[n_r, Hkv, D]`` views of
consecutive pool pages (a :class:`~oomb.engine.kv_store.PagedKVStore` layer whose pages are
consecutive: one run; an offloaded store's resident pages and staging buffer: one or two runs
per segment), with no packed-document mask; the engine sends every other call to the paged
Triton kernels.

Why: on an H200 the cuDNN fused attention behind ``torch.nn.functional.scaled_dot_product_attention``
runs this split at ~580 TFLOP/s forward and ~520 backward on the Qwen2.5-7B shape (4096 queries,
32K-128K past), where our Triton kernels reach ~443 / ~390 (benchmarks/results/
sdpa_attention_kernels_h200.md). Where the layout allows it, the chunk-recurrent
step then runs its attention at the speed of the full-sequence baseline's.

Algorithm: the attention is split into calls over disjoint keys -- the chunk's queries
over each run of the past (no mask) and over its own keys (causal, square) -- merged with the
log-sum-exp rule, as FlashAttention's split-KV decoding and ring attention do (two parts shown;
more are merged one after the other)::

    lse = logaddexp(lse_past, lse_own)
    out = exp(lse_past - lse) * out_past + exp(lse_own - lse) * out_own      (in float32)

The backward runs every call's backward kernel with the FINAL ``out`` and ``lse``: a
FlashAttention backward recomputes ``P = exp(scale * q k^T - lse)`` and uses
``delta = rowsum(dout * out)``, which with the merged values are exactly each part's share of
the full softmax (Dao 2023, §3.2), so dq = dq_past + dq_own and the past's dk/dv come out
exact. Each part's outputs are rounded to the input dtype once before the merge (cuDNN has no
float32 output), one rounding more than a single fused kernel. On CUDA the merge is one Triton
kernel (:mod:`oomb.ops.triton.lse_merge`), elsewhere :func:`merge_parts`.

Primitives: on CUDA ``torch.ops.aten._scaled_dot_product_cudnn_attention`` and its backward
(grouped-query attention passed as is: the K/V keep their Hkv heads); on CPU
``_scaled_dot_product_flash_attention_for_cpu`` and its backward (K/V expanded to Hq heads and
dk/dv summed back), which lets the CPU tests check the split, the merge and the backward
with the final out/lse.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

__all__ = ["MAX_RUN_TOKENS", "merge_parts", "sdpa_available", "sdpa_attention_fwd", "sdpa_attention_bwd"]

MAX_RUN_TOKENS = 131072
"""Longest piece of a past run one fused-attention call reads; a longer run is split into calls of at most this
many tokens, merged like any other parts. It bounds the backward's workspace, which grows with the keys of a call:
cuDNN holds 4 (Hq + Hkv) D bytes per past token of a call beyond its inputs and outputs -- the past dK/dV in bf16
and, with grouped-query attention, dK/dV for every query head (``benchmarks/results/sdpa_backward_memory_h200.jsonl``,
H200, cuDNN 9.19; 2 GiB per call for the Qwen2.5-7B shape at this length). The memory model counts it
(:func:`oomb.memory.activation_bytes`)."""

_DTYPES_CUDA = (torch.float16, torch.bfloat16)
_HEAD_DIMS_CUDA = (64, 80, 96, 128)  # what cuDNN's fused SDPA runs on Hopper for training (d <= 128, d % 8 == 0)


@lru_cache(maxsize=None)
def _cudnn_ok(index: int) -> bool:
    if not torch.backends.cudnn.is_available() or not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return False
    major, _ = torch.cuda.get_device_capability(index)
    return major >= 9 and (torch.backends.cudnn.version() or 0) >= 90000


def sdpa_available(q: torch.Tensor) -> bool:
    """Whether :func:`sdpa_attention_fwd`/``_bwd`` run for queries like ``q`` ([C, Hq, D]).

    CUDA: cuDNN >= 9 on a Hopper-or-newer GPU, bf16/fp16, head dim 64/80/96/128. CPU: always
    (PyTorch's CPU flash kernel; float32/float64 too).
    """
    if q.device.type == "cpu":
        return True
    if q.device.type != "cuda" or q.dtype not in _DTYPES_CUDA or q.shape[-1] not in _HEAD_DIMS_CUDA:
        return False
    return _cudnn_ok(q.device.index if q.device.index is not None else torch.cuda.current_device())


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [1, H, T, D] (a view; the primitives take these strides)."""
    return x.unsqueeze(0).transpose(1, 2)


def _expand(x: torch.Tensor, group: int) -> torch.Tensor:
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _part_fwd(q4, k4, v4, causal: bool, scale: float):
    """One SDPA call -> (out [1, Hq, L, D] in q's dtype, lse [Hq, L] float32/float64)."""
    Hq, L = q4.shape[1], q4.shape[2]
    if q4.device.type == "cuda":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, causal, False, scale=scale)
        return res[0], res[1].reshape(Hq, L)
    g = Hq // k4.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q4, _expand(k4, g), _expand(v4, g), 0.0, causal, scale=scale)
    return out, lse.reshape(Hq, L)


def _part_bwd(do4, q4, k4, v4, o4, lse, causal: bool, scale: float):
    """Backward of one SDPA call with the given (final) out and lse -> (dq, dk, dv) shaped like q4, k4, v4."""
    Hq, L, S = q4.shape[1], q4.shape[2], k4.shape[2]
    if q4.device.type == "cuda":
        # philox seed/offset (no dropout), attn_bias, cum_seq_q/k (not nested): undefined tensors
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do4, q4, k4, v4, o4, lse.reshape(1, Hq, L, 1), None, None, None, None, None, L, S, 0.0, causal,
            scale=scale)
    g = Hq // k4.shape[1]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do4, q4, _expand(k4, g), _expand(v4, g), o4, lse.reshape(1, Hq, L), 0.0, causal, scale=scale)
    if g > 1:
        dk = dk.unflatten(1, (-1, g)).sum(2)
        dv = dv.unflatten(1, (-1, g)).sum(2)
    return dq, dk, dv


def _pieces(runs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The runs cut into views of at most :data:`MAX_RUN_TOKENS` tokens, in token order."""
    n = MAX_RUN_TOKENS
    return [(a[i : i + n], b[i : i + n]) for a, b in runs for i in range(0, a.shape[0], n)]


def sdpa_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: Sequence[tuple[torch.Tensor, torch.Tensor]],
    softmax_scale: float, *, include_own: bool = True, out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of one chunk over a past held in a few contiguous runs, plus its own keys (causal).

    Args:
        q: [C, Hq, D]; k, v: [C, Hkv, D] the chunk's own (Hq a multiple of Hkv).
        past: the past K/V as runs in token order, ``(k_run, v_run)`` of [n_r, Hkv, D] each in q's dtype (any
            strides with a unit last stride); empty for no past. Each run is one unmasked SDPA call (or several, of
            at most :data:`MAX_RUN_TOKENS` tokens each).
        softmax_scale: multiplier of q·k.
        include_own: attend to the chunk's own keys too (False: the past runs only, as one segment of a
            segmented past whose own keys go with its last segment; then ``past`` must not be empty).
        out_dtype: dtype of ``out`` (default q's); float32 keeps a multi-part merge unrounded for a caller that
            merges further.

    Returns:
        out [C, Hq, D] in ``out_dtype``, lse [Hq, C] float32 (float64 for float64 inputs), natural log. With one
        past run and the own keys this is exactly the two-part split of the module docstring; more parts are
        merged one after the other in float32 (float64) and rounded once.
    """
    q4 = _bhsd(q)
    parts = [_part_fwd(q4, _bhsd(pk), _bhsd(pv), False, softmax_scale) for pk, pv in _pieces(past)]
    if include_own:
        parts.append(_part_fwd(q4, _bhsd(k), _bhsd(v), True, softmax_scale))
    if not parts:
        raise ValueError("sdpa_attention_fwd: no keys (no past runs and include_own=False)")
    dtype = out_dtype or q.dtype
    if len(parts) == 1:
        out, lse = parts[0]
        return out[0].transpose(0, 1).to(dtype), lse
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    merge = _triton_merge() if q.is_cuda and _triton_merge() is not None else merge_parts  # one pass, not ~8 kernels
    out, lse = parts[0][0][0], parts[0][1]
    for i, (o, l) in enumerate(parts[1:], 2):
        out, lse = merge(out, lse, o[0], l, dtype if i == len(parts) else acc)
        out = out.transpose(0, 1)  # [Hq, C, D] for the next merge
    return out.transpose(0, 1), lse


def merge_parts(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of two parts over disjoint keys, in PyTorch ops (the reference of
    :func:`oomb.ops.triton.lse_merge.lse_merge`, same arguments): out [C, Hq, D] in ``dtype``, lse [Hq, C]
    float32 (float64 for float64 parts). Both lse must be finite."""
    acc = torch.float64 if out_a.dtype == torch.float64 else torch.float32
    lse_a, lse_b = lse_a.to(acc), lse_b.to(acc)
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a.to(acc) * torch.exp(lse_a - lse)[..., None] + out_b.to(acc) * torch.exp(lse_b - lse)[..., None]
    return out.transpose(0, 1).to(dtype), lse


@lru_cache(maxsize=None)
def _triton_merge():
    try:
        from .triton.lse_merge import lse_merge
    except Exception:  # pragma: no cover - triton missing or broken: the PyTorch merge
        return None
    return lse_merge


def sdpa_attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    past: Sequence[tuple[torch.Tensor, torch.Tensor]], past_grad: Sequence[tuple[torch.Tensor, torch.Tensor]],
    softmax_scale: float, *, include_own: bool = True, dq_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Backward of :func:`sdpa_attention_fwd`; adds each past run's dK/dV into its gradient views in place.

    Args:
        dout, out: [C, Hq, D]; q, k, v, past, include_own as in :func:`sdpa_attention_fwd`. ``out`` and ``lse``
            are the FINAL ones (of the whole attention, every segment merged).
        lse: [Hq, C] from the forward.
        past_grad: ``(dk_run, dv_run)`` float32/float64 [n_r, Hkv, D] views of the gradient storage, one per run
            of ``past`` (same lengths); empty for no past.
        dq_dtype: dtype of ``dq`` (default q's).

    Returns:
        dq [C, Hq, D] in ``dq_dtype``; dk, dv [C, Hkv, D] in q's dtype, the own chunk's (nothing stored added),
        or None without ``include_own``.

    Raises:
        ValueError: ``past_grad`` does not pair with ``past``.
    """
    if len(past_grad) != len(past):
        raise ValueError(f"sdpa_attention_bwd: {len(past)} past runs but {len(past_grad)} gradient runs")
    q4, o4, do4 = _bhsd(q), _bhsd(out), _bhsd(dout)
    dqs, dk, dv = [], None, None
    if include_own:
        dq, dk, dv = _part_bwd(do4, q4, _bhsd(k), _bhsd(v), o4, lse, True, softmax_scale)
        dqs.append(dq[0].transpose(0, 1))
        dk, dv = dk[0].transpose(0, 1), dv[0].transpose(0, 1)
    for (pk, pv), (pdk, pdv) in zip(_pieces(past), _pieces(past_grad)):
        dq_p, dk_p, dv_p = _part_bwd(do4, q4, _bhsd(pk), _bhsd(pv), o4, lse, False, softmax_scale)
        pdk.add_(dk_p[0].transpose(0, 1))
        pdv.add_(dv_p[0].transpose(0, 1))
        dqs.append(dq_p[0].transpose(0, 1))
    if not dqs:
        raise ValueError("sdpa_attention_bwd: no keys (no past runs and include_own=False)")
    dtype = dq_dtype or q.dtype
    if len(dqs) == 1:
        return dqs[0].to(dtype), dk, dv
    if len(dqs) == 2 and dtype == q.dtype:
        # One add: for bf16/fp16 PyTorch adds in float32 and rounds once, as (dq.float() + dq_p.float()).to(dtype) would.
        return dqs[0] + dqs[1], dk, dv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = dqs[0].to(acc)
    for d in dqs[1:]:
        dq += d
    return dq.to(dtype), dk, dv
