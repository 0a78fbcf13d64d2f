"""``@triton.jit`` tile helpers shared by the paged and sparse attention kernels (shape legend and algorithm:
:mod:`oomb.ops.triton.paged_attention`). They check nothing: the launchers validate every input."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_dq_tile", "_fwd_tile", "_load_rows", "_past_from", "_past_token_offsets"]

@triton.jit
def _load_rows(ptr, row_off, r_mask, offs_d, d_mask, stride_d):
    """[BLOCK_M, BLOCK_D] tile at ptr + row_off[r] + d * stride_d (masked rows/dims read 0)."""
    return tl.load(ptr + row_off[:, None] + offs_d[None, :] * stride_d, mask=r_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _past_token_offsets(block_table_ptr, tok, tok_mask, stride_p, stride_t, PAGE_SIZE: tl.constexpr):
    """Element offsets (int64) of past tokens ``tok`` in a [P, S, Hkv, D] pool, through the block table."""
    page = tl.load(block_table_ptr + tok // PAGE_SIZE, mask=tok_mask, other=0).to(tl.int64)
    return page * stride_p + (tok % PAGE_SIZE).to(tl.int64) * stride_t


@triton.jit
def _past_from(past_start, PART: tl.constexpr):
    """The first past token of a launch: ``past_start`` for a part (PART), else the literal 0.

    Measured (H200, 4096 queries, Qwen2.5-7B heads):
    with the past loops starting at the runtime ``past_start`` the forward ran at 327 / 320
    TFLOP/s at 32K / 128K past against 384 / 384 for the same kernel before parts existed
    (bitwise-equal outputs, same autotuned config); a ``tl.multiple_of`` hint on the tile start
    did not change that. With the start a literal 0 for whole-past launches (the dense path) the
    loops compile as before and the forward is back at 383 / 383. Only parts (offload segments)
    pay for the runtime start."""
    if PART:
        start = past_start
    else:
        start = 0
    return start


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, k, v, s_mask, qk_scale, MASKED: tl.constexpr, DOT_PREC: tl.constexpr):
    """One online-softmax step (log2 domain): scores of q [M, D] against k [N, D], update acc/m_i/l_i."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [M, N], log2 units
    if MASKED:
        s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        # A row with no visible key yet (packed documents) keeps m = -inf: exponentiate against 0
        # instead, so p and alpha are 0 rather than NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _dq_tile(dq, q, do, k, v, lse2, delta, s_mask, qk_scale, MASKED: tl.constexpr, DOT_PREC: tl.constexpr):
    """dq += ds @ k for one key tile, with p recomputed from lse (log2 units)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    p = tl.exp2(s - lse2[:, None])
    if MASKED:
        p = tl.where(s_mask, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)

