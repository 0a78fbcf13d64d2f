"""``@triton.jit`` tile helpers shared by the paged and sparse attention kernels (shape legend and algorithm:
:mod:`oomb.ops.triton.paged_attention`). They check nothing: the launchers validate every input."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_dq_tile", "_fwd_tile", "_load_rows", "_own_dq", "_own_fwd", "_past_from", "_past_token_offsets"]

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



@triton.jit
def _own_tile(ko, vo, j0, C, offs_n, offs_d, d_mask, stride_k_c, stride_k_d, stride_v_c, stride_v_d, UPCAST: tl.constexpr):
    """Own keys/values [BLOCK_N, BLOCK_D] from chunk position ``j0`` (rows past C read 0), and the key positions."""
    j = j0 + offs_n
    j_mask = j < C
    k = _load_rows(ko, j.to(tl.int64) * stride_k_c, j_mask, offs_d, d_mask, stride_k_d)
    v = _load_rows(vo, j.to(tl.int64) * stride_v_c, j_mask, offs_d, d_mask, stride_v_d)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v, j, j_mask


@triton.jit
def _own_range(i_lo, doc_lo, past_len, HAS_DOC: tl.constexpr, BLOCK_N: tl.constexpr):
    """(end of the unmasked own tiles, start of the masked ones) for a row tile whose first query is ``i_lo``.

    Causal: own key j is visible to query i iff j <= i, so tiles entirely at or below the first query need no
    mask and the diagonal tiles do. Packed documents (own key j at absolute token past_len + j): tiles before
    the tile's first document start ``doc_lo`` are skipped and every other own tile is masked."""
    own_full = ((i_lo + 1) // BLOCK_N) * BLOCK_N
    masked_start = own_full
    if HAS_DOC:
        masked_start = ((tl.maximum(doc_lo - past_len, 0)) // BLOCK_N) * BLOCK_N
        own_full = 0
    return own_full, masked_start


@triton.jit
def _own_fwd(acc, m_i, l_i, q, ko, vo, i_q, i_lo, i_hi, doc, doc_lo, C, past_len, qk_scale, offs_n, offs_d, d_mask,
             stride_k_c, stride_k_d, stride_v_c, stride_v_d,
             HAS_DOC: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online-softmax steps of rows with queries ``i_q`` (in [i_lo, i_hi]) over the chunk's own keys ``ko``/``vo``
    ([C, D] of one KV head), causal, packed documents masked (``doc``: absolute first token of each row's
    document, HAS_DOC only)."""
    own_full, masked_start = _own_range(i_lo, doc_lo, past_len, HAS_DOC, BLOCK_N)
    for j0 in range(0, own_full, BLOCK_N):
        k, v, j, j_mask = _own_tile(ko, vo, j0, C, offs_n, offs_d, d_mask, stride_k_c, stride_k_d, stride_v_c, stride_v_d, UPCAST)
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, None, qk_scale, False, DOT_PREC)
    for j0 in range(masked_start, i_hi + 1, BLOCK_N):
        k, v, j, j_mask = _own_tile(ko, vo, j0, C, offs_n, offs_d, d_mask, stride_k_c, stride_k_d, stride_v_c, stride_v_d, UPCAST)
        s_mask = (j[None, :] <= i_q[:, None]) & j_mask[None, :]
        if HAS_DOC:
            s_mask = s_mask & ((past_len + j)[None, :] >= doc[:, None])
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, s_mask, qk_scale, True, DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def _own_dq(dq, q, do, ko, vo, lse2, delta, i_q, i_lo, i_hi, doc, doc_lo, C, past_len, qk_scale, offs_n, offs_d, d_mask,
            stride_k_c, stride_k_d, stride_v_c, stride_v_d,
            HAS_DOC: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq of rows with queries ``i_q`` over the chunk's own keys (as :func:`_own_fwd`; p recomputed from lse)."""
    own_full, masked_start = _own_range(i_lo, doc_lo, past_len, HAS_DOC, BLOCK_N)
    for j0 in range(0, own_full, BLOCK_N):
        k, v, j, j_mask = _own_tile(ko, vo, j0, C, offs_n, offs_d, d_mask, stride_k_c, stride_k_d, stride_v_c, stride_v_d, UPCAST)
        dq = _dq_tile(dq, q, do, k, v, lse2, delta, None, qk_scale, False, DOT_PREC)
    for j0 in range(masked_start, i_hi + 1, BLOCK_N):
        k, v, j, j_mask = _own_tile(ko, vo, j0, C, offs_n, offs_d, d_mask, stride_k_c, stride_k_d, stride_v_c, stride_v_d, UPCAST)
        s_mask = (j[None, :] <= i_q[:, None]) & j_mask[None, :]
        if HAS_DOC:
            s_mask = s_mask & ((past_len + j)[None, :] >= doc[:, None])
        dq = _dq_tile(dq, q, do, k, v, lse2, delta, s_mask, qk_scale, True, DOT_PREC)
    return dq
