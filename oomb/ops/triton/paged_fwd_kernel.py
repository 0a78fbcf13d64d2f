"""Forward kernel of the Triton paged attention: one program per (row tile, KV head) runs over all past tiles,
then over its own chunk's causal tiles (FlashAttention-2 §3.1, online softmax in the log2 domain).

Contract, layout and algorithm: :mod:`oomb.ops.triton.paged_attention`, whose launcher validates every input
(the kernel checks nothing).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .autotune import AUTOTUNE_KEY, tuned
from .tiles import _fwd_tile, _load_rows, _past_from, _past_token_offsets

__all__ = ["FWD_GPU_CONFIGS", "_paged_attn_fwd_kernel"]

FWD_GPU_CONFIGS = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)]
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) the forward is autotuned over on a GPU (the first: ``autotune='first'``)."""


@tuned(FWD_GPU_CONFIGS, key=AUTOTUNE_KEY)
@triton.jit
def _paged_attn_fwd_kernel(
    q_ptr,  # [C, Hq, D]
    k_ptr,  # [C, Hkv, D] own keys
    v_ptr,  # [C, Hkv, D] own values
    k_cache_ptr,  # [P, S, Hkv, D]
    v_cache_ptr,  # [P, S, Hkv, D]
    block_table_ptr,  # int32 [>= ceil(past_len / S)]
    out_ptr,  # [C, Hq, D]
    lse_ptr,  # fp32 [Hq, C]
    doc_ptr,  # int32 [C] absolute first token of each query's document (HAS_DOC only)
    C,
    past_start,  # first past token read (the part's start; 0 = the whole past)
    past_len,
    qk_scale,  # softmax_scale * log2(e)
    n_rows, n_cols,  # USE_TMA: the pools seen as [n_rows, n_cols] = [P * S, Hkv * D]
    stride_q_c, stride_q_h, stride_q_d,
    stride_k_c, stride_k_h, stride_k_d,
    stride_v_c, stride_v_h, stride_v_d,
    stride_kc_p, stride_kc_t, stride_kc_h, stride_kc_d,
    stride_vc_p, stride_vc_t, stride_vc_h, stride_vc_d,
    stride_o_c, stride_o_h, stride_o_d,
    stride_lse_h,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_OWN: tl.constexpr,  # False: a past-only part (the chunk's own keys are left out)
    PART: tl.constexpr,  # past_start > 0 (see tiles._past_from)
    USE_TMA: tl.constexpr,  # full past tiles through tensor descriptors (see tma.use_tma)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    hkv = tl.program_id(1).to(tl.int64)
    row0 = pid_m * BLOCK_M
    offs_r = row0 + tl.arange(0, BLOCK_M)  # flattened (query, head-in-group) rows
    r_mask = offs_r < C * G
    i_q = offs_r // G  # query position in the chunk
    head = hkv * G + offs_r % G  # query head (int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    q = _load_rows(q_ptr, i_q.to(tl.int64) * stride_q_c + head * stride_q_h, r_mask, offs_d, d_mask, stride_q_d)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    kc = k_cache_ptr + hkv * stride_kc_h
    vc = v_cache_ptr + hkv * stride_vc_h
    past_start = _past_from(past_start, PART)
    n_full = past_start + ((past_len - past_start) // BLOCK_N) * BLOCK_N
    if HAS_DOC:
        # Packed documents: key t is visible to query i iff doc[i] <= t. Document starts grow
        # with i, so the tile's first query bounds where any of its rows starts; tiles before
        # that are skipped, the rest masked.
        doc = tl.load(doc_ptr + i_q, mask=r_mask, other=0)
        doc_lo = tl.load(doc_ptr + row0 // G)
        doc_first = tl.minimum(tl.maximum(doc_lo, past_start), past_len)
        for start in range(past_start + ((doc_first - past_start) // BLOCK_N) * BLOCK_N, past_len, BLOCK_N):
            tok = start + offs_n
            tok_mask = tok < past_len
            k = _load_rows(kc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_kc_p, stride_kc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_kc_d)
            v = _load_rows(vc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_vc_p, stride_vc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_vc_d)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s_mask = tok_mask[None, :] & (tok[None, :] >= doc[:, None])
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, s_mask, qk_scale, True, DOT_PREC)
        n_full = 0  # the loops below see no past
        past_end = 0
    else:
        past_end = past_len

    # (a) Past tokens through the block table: full tiles unmasked, then the tail tile.
    if USE_TMA:
        # A full tile lies inside one page (PAGE_SIZE % BLOCK_N == 0): one page lookup, then one
        # [BLOCK_N, HEAD_DIM] box of the pool seen as [pages * PAGE_SIZE, Hkv * HEAD_DIM] rows.
        k_desc = tl.make_tensor_descriptor(k_cache_ptr, shape=[n_rows, n_cols], strides=[n_cols, 1], block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_cache_ptr, shape=[n_rows, n_cols], strides=[n_cols, 1], block_shape=[BLOCK_N, BLOCK_D])
        col = (hkv * HEAD_DIM).to(tl.int32)
        for start in range(past_start, n_full, BLOCK_N):
            slot = tl.load(block_table_ptr + start // PAGE_SIZE)
            row = slot * PAGE_SIZE + start % PAGE_SIZE
            k = k_desc.load([row, col])
            v = v_desc.load([row, col])
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, None, qk_scale, False, DOT_PREC)
    else:
        for start in range(past_start, n_full, BLOCK_N):
            tok = start + offs_n
            tok_mask = tok < past_len
            k = _load_rows(kc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_kc_p, stride_kc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_kc_d)
            v = _load_rows(vc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_vc_p, stride_vc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_vc_d)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, None, qk_scale, False, DOT_PREC)
    if n_full < past_end:
        tok = n_full + offs_n
        tok_mask = tok < past_len
        k = _load_rows(kc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_kc_p, stride_kc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_kc_d)
        v = _load_rows(vc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_vc_p, stride_vc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_vc_d)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, tok_mask[None, :], qk_scale, True, DOT_PREC)

    if HAS_OWN:
        # (b) Own chunk, causal (key j visible to query i iff j <= i). Tiles entirely at or
        # below the tile's first query need no mask; the diagonal tiles do.
        i_lo = row0 // G
        i_hi = tl.minimum((row0 + BLOCK_M - 1) // G, C - 1)
        own_full = ((i_lo + 1) // BLOCK_N) * BLOCK_N
        ko = k_ptr + hkv * stride_k_h
        vo = v_ptr + hkv * stride_v_h
        own_masked_start = own_full
        if HAS_DOC:
            # Own key j sits at absolute token past_len + j: tiles before the tile's first
            # document start are skipped, every other own tile is masked by document.
            own_masked_start = ((tl.maximum(doc_lo - past_len, 0)) // BLOCK_N) * BLOCK_N
            own_full = 0
        for j0 in range(0, own_full, BLOCK_N):
            j = j0 + offs_n
            j_mask = j < C
            k = _load_rows(ko, j.to(tl.int64) * stride_k_c, j_mask, offs_d, d_mask, stride_k_d)
            v = _load_rows(vo, j.to(tl.int64) * stride_v_c, j_mask, offs_d, d_mask, stride_v_d)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, None, qk_scale, False, DOT_PREC)
        for j0 in range(own_masked_start, i_hi + 1, BLOCK_N):
            j = j0 + offs_n
            j_mask = j < C
            k = _load_rows(ko, j.to(tl.int64) * stride_k_c, j_mask, offs_d, d_mask, stride_k_d)
            v = _load_rows(vo, j.to(tl.int64) * stride_v_c, j_mask, offs_d, d_mask, stride_v_d)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s_mask = (j[None, :] <= i_q[:, None]) & j_mask[None, :]
            if HAS_DOC:
                s_mask = s_mask & ((past_len + j)[None, :] >= doc[:, None])
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, s_mask, qk_scale, True, DOT_PREC)

    if HAS_OWN:
        # Every real row saw at least own key 0, so l_i > 0.
        acc = acc / l_i[:, None]
    else:
        # A past-only part may leave a row with no visible key (packed documents): its m_i is
        # -inf and l_i 0; dividing by 1 instead gives out 0 and lse -inf.
        l_i = tl.where(l_i > 0, l_i, 1.0)
        acc = acc / l_i[:, None]
    o_off = i_q.to(tl.int64) * stride_o_c + head * stride_o_h
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :] * stride_o_d, acc.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # natural-log units
    tl.store(lse_ptr + head * stride_lse_h + i_q, lse, mask=r_mask)
