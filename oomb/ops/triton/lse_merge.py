"""One-pass Triton merge of two attention parts by their log-sum-exp (the 'sdpa' backend's forward).

For each (head h, query c)::

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b      (float32, rounded once)

In PyTorch ops this is five elementwise kernels and three dtype conversions over [C, Hq, D]
per (chunk, layer); here one kernel reads each part once and writes ``out`` and ``lse``. Both
lse must be finite (each part of the 'sdpa' split has at least one key per row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["lse_merge"]


@triton.jit
def _lse_merge_kernel(
    a_ptr, b_ptr, la_ptr, lb_ptr, out_ptr, lse_ptr,
    C, D,
    stride_ah, stride_ac, stride_bh, stride_bc, stride_oc, stride_oh,
    BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    c_mask = offs_c < C
    mask = c_mask[:, None] & (offs_d[None, :] < D)
    la = tl.load(la_ptr + h * C + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    lb = tl.load(lb_ptr + h * C + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    m = tl.maximum(la, lb)
    lse = m + tl.log(tl.exp(la - m) + tl.exp(lb - m))
    wa = tl.exp(la - lse)
    wb = tl.exp(lb - lse)
    a = tl.load(a_ptr + h * stride_ah + offs_c[:, None] * stride_ac + offs_d[None, :], mask=mask, other=0.0)
    b = tl.load(b_ptr + h * stride_bh + offs_c[:, None] * stride_bc + offs_d[None, :], mask=mask, other=0.0)
    o = a.to(tl.float32) * wa[:, None] + b.to(tl.float32) * wb[:, None]
    tl.store(out_ptr + offs_c[:, None] * stride_oc + h * stride_oh + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=mask)
    tl.store(lse_ptr + h * C + offs_c, lse, mask=c_mask)


def lse_merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two parts of one attention over disjoint keys.

    Args:
        out_a, out_b: [Hq, C, D] (any strides with a unit last stride; e.g. ``out[0]`` of a [1, Hq, C, D] SDPA output).
        lse_a, lse_b: [Hq, C] contiguous, finite (float32).
        dtype: dtype of the merged ``out``.

    Returns:
        out [C, Hq, D] contiguous in ``dtype``; lse [Hq, C] float32.

    Raises:
        ValueError: on mismatched shapes or a non-unit last stride.
    """
    Hq, C, D = out_a.shape
    if out_b.shape != out_a.shape or lse_a.shape != (Hq, C) or lse_b.shape != (Hq, C):
        raise ValueError(f"lse_merge: shapes {tuple(out_a.shape)}, {tuple(out_b.shape)}, {tuple(lse_a.shape)}, "
                         f"{tuple(lse_b.shape)} do not match [Hq, C, D] x2 and [Hq, C] x2")
    if out_a.stride(2) != 1 or out_b.stride(2) != 1:
        raise ValueError("lse_merge: the head dim of out_a and out_b must be contiguous (last stride 1)")
    lse_a, lse_b = lse_a.contiguous(), lse_b.contiguous()
    out = torch.empty((C, Hq, D), dtype=dtype, device=out_a.device)
    lse = torch.empty((Hq, C), dtype=torch.float32, device=out_a.device)
    block_d = triton.next_power_of_2(D)
    block_c = max(1, min(64, 8192 // block_d))
    grid = (triton.cdiv(C, block_c), Hq)
    _lse_merge_kernel[grid](
        out_a, out_b, lse_a, lse_b, out, lse, C, D,
        out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1), out.stride(0), out.stride(1),
        BLOCK_C=block_c, BLOCK_D=block_d,
    )
    return out, lse
