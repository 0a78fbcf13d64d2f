"""Kernels of the Triton sparse paged attention: forward and dq over each query block's selected past pages and the
chunk's own keys (causal) in one pass, and dK/dV per selected (past page, token tile, KV head) through the inverse
(CSR) map of the selection (the own keys' dK/dV are the dense kernel's).

Contract and work split: :mod:`oomb.ops.triton.sparse_attention`, whose launchers validate every input (the
kernels check nothing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .autotune import RestoreRows, tuned
from .tiles import _dq_tile, _fwd_tile, _load_rows, _own_dq, _own_fwd

__all__ = ["DKDV_GPU_CONFIGS", "DQ_GPU_CONFIGS", "FWD_GPU_CONFIGS", "_sparse_attn_bwd_dkdv_kernel",
           "_sparse_attn_bwd_dq_kernel", "_sparse_attn_fwd_kernel"]

FWD_GPU_CONFIGS = [(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)]
DQ_GPU_CONFIGS = [(128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3)]
DKDV_GPU_CONFIGS = [(64, 128, 8, 3), (64, 64, 4, 3), (32, 128, 8, 2)]
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) the sparse kernels are autotuned over on a GPU."""
_KEY = ["G", "HEAD_DIM", "PAGE_SIZE", "BLOCK_Q", "HAS_DOC", "USE_TMA"]
_DKDV_KEY = ["G", "HEAD_DIM", "PAGE_SIZE", "BLOCK_Q", "HAS_DOC", "QO_TMA"]


def _dkdv_rows(nargs: dict) -> torch.Tensor:
    """Pool pages the sparse dK/dV launch writes: the slots of the past pages some (KV head, page) pair of the CSR
    selects (autotuning only; synchronises)."""
    n = int(nargs["n_pages"])
    off = nargs["csr_offsets_ptr"]
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=off.device)
    cnt = (off[1:] - off[:-1]).view(-1, n)  # [Hkv, n]
    pages = torch.nonzero(cnt.gt(0).any(0)).flatten()
    return nargs["block_table_ptr"][pages].long().unique()


_DKDV_RESTORE = RestoreRows(("dk_cache_ptr", "dv_cache_ptr"), _dkdv_rows)


@triton.jit
def _block_rows(pid, C, G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program -> (query block b, first row, end row of the block, rows [BLOCK_M], first and last query of the
    tile's rows). The last block comes first: it has the most own (causal) keys, so the longest programs start
    first instead of running alone at the end."""
    tiles = tl.cdiv(BLOCK_Q * G, BLOCK_M)
    b = tl.cdiv(C, BLOCK_Q) - 1 - pid // tiles
    row0 = b * BLOCK_Q * G + (pid % tiles) * BLOCK_M
    row_end = tl.minimum((b + 1) * BLOCK_Q, C) * G
    i_hi = (tl.minimum(row0 + BLOCK_M, row_end) - 1) // G
    return b, row0, row_end, row0 + tl.arange(0, BLOCK_M), row0 // G, i_hi


@triton.jit
def _selected_tokens(sel_row_ptr, block_table_ptr, u, u_mask, past_len, PAGE_SIZE: tl.constexpr):
    """Virtual tokens u of a block's selection -> (logical token, pool page (int64), slot token, mask)."""
    logical = tl.load(sel_row_ptr + u // PAGE_SIZE, mask=u_mask, other=0)
    phys = tl.load(block_table_ptr + logical, mask=u_mask, other=0).to(tl.int64)
    t = u % PAGE_SIZE
    tok = logical * PAGE_SIZE + t
    return tok, phys, t.to(tl.int64), u_mask & (tok < past_len)


@triton.jit
def _full_virtual_tokens(sel_row_ptr, n_cnt, past_len, PAGE_SIZE: tl.constexpr):
    """Virtual tokens of a block's selection that lie in full pages: all of them unless the last selected page (the
    highest, as selections are ascending) is the partial last page of the past, whose tile then stays masked."""
    last = tl.load(sel_row_ptr + tl.maximum(n_cnt - 1, 0))
    partial = (n_cnt > 0) & ((last + 1) * PAGE_SIZE > past_len)
    return tl.where(partial, n_cnt - 1, n_cnt) * PAGE_SIZE


@triton.jit
def _page_tile(k_desc, v_desc, sel_row_ptr, block_table_ptr, u0, col, PAGE_SIZE: tl.constexpr, UPCAST: tl.constexpr):
    """K and V [BLOCK_N, BLOCK_D] of virtual tile ``u0`` (inside one full selected page) through the descriptors of
    the pools seen as [pages * PAGE_SIZE, Hkv * D], at column ``col`` (the KV head's first)."""
    logical = tl.load(sel_row_ptr + u0 // PAGE_SIZE)
    slot = tl.load(block_table_ptr + logical)
    row = slot * PAGE_SIZE + u0 % PAGE_SIZE
    k = k_desc.load([row, col])
    v = v_desc.load([row, col])
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@tuned(FWD_GPU_CONFIGS, key=_KEY)
@triton.jit
def _sparse_attn_fwd_kernel(
    q_ptr,  # [C, Hq, D]
    k_ptr,  # [C, Hkv, D] own keys
    v_ptr,  # [C, Hkv, D] own values
    k_cache_ptr,  # [P, S, Hkv, D]
    v_cache_ptr,  # [P, S, Hkv, D]
    block_table_ptr,  # int32 [n] logical past page -> pool page
    sel_ptr,  # int32 [nb, Hkv, K] selected logical pages (ascending)
    counts_ptr,  # int32 [nb, Hkv]
    out_ptr,  # [C, Hq, D] attention over the selected past and the own chunk (causal), q's dtype
    lse_ptr,  # fp32 [Hq, C] its log-sum-exp
    doc_ptr,  # int32 [C] absolute first token of each query's document (HAS_DOC only)
    C,
    past_len,
    qk_scale,  # softmax_scale * log2(e)
    n_rows, n_cols,  # USE_TMA: the pools seen as [n_rows, n_cols] = [P * S, Hkv * D]
    stride_q_c, stride_q_h, stride_q_d,
    stride_k_c, stride_k_h, stride_k_d,
    stride_v_c, stride_v_h, stride_v_d,
    stride_kc_p, stride_kc_t, stride_kc_h, stride_kc_d,
    stride_vc_p, stride_vc_t, stride_vc_h, stride_vc_d,
    stride_sel_b, stride_sel_h,
    stride_cnt_b, stride_cnt_h,
    stride_o_c, stride_o_h, stride_o_d,
    stride_lse_h,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_DOC: tl.constexpr,
    USE_TMA: tl.constexpr,  # full-page tiles through tensor descriptors (see tma.use_tma)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    hkv = tl.program_id(1).to(tl.int64)
    b, row0, row_end, offs_r, i_lo, i_hi = _block_rows(tl.program_id(0), C, G, BLOCK_Q, BLOCK_M)
    r_mask = offs_r < row_end
    i_q = offs_r // G
    head = hkv * G + offs_r % G
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    q = _load_rows(q_ptr, i_q.to(tl.int64) * stride_q_c + head * stride_q_h, r_mask, offs_d, d_mask, stride_q_d)
    if UPCAST:
        q = q.to(tl.float32)
    doc = i_q  # read only with HAS_DOC
    doc_lo = row0
    if HAS_DOC:
        doc = tl.load(doc_ptr + i_q, mask=r_mask, other=0)
        doc_lo = tl.load(doc_ptr + i_lo)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kc = k_cache_ptr + hkv * stride_kc_h
    vc = v_cache_ptr + hkv * stride_vc_h
    sel_row = sel_ptr + b * stride_sel_b + hkv * stride_sel_h
    n_cnt = tl.load(counts_ptr + b * stride_cnt_b + hkv * stride_cnt_h)
    n_virt = n_cnt * PAGE_SIZE
    u_start = 0
    if USE_TMA:
        # Tiles of full pages (PAGE_SIZE % BLOCK_N == 0): one box each of the pool seen as
        # [pages * PAGE_SIZE, Hkv * HEAD_DIM], unmasked; a partial last page goes through the gather below.
        k_desc = tl.make_tensor_descriptor(k_cache_ptr, shape=[n_rows, n_cols], strides=[n_cols, 1], block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_cache_ptr, shape=[n_rows, n_cols], strides=[n_cols, 1], block_shape=[BLOCK_N, BLOCK_D])
        col = (hkv * HEAD_DIM).to(tl.int32)
        u_start = _full_virtual_tokens(sel_row, n_cnt, past_len, PAGE_SIZE)
        for u0 in range(0, u_start, BLOCK_N):
            k, v = _page_tile(k_desc, v_desc, sel_row, block_table_ptr, u0, col, PAGE_SIZE, UPCAST)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, None, qk_scale, False, DOT_PREC)
    for u0 in range(u_start, n_virt, BLOCK_N):
        u = u0 + offs_n
        tok, phys, t, tok_mask = _selected_tokens(sel_row, block_table_ptr, u, u < n_virt, past_len, PAGE_SIZE)
        k = _load_rows(kc, phys * stride_kc_p + t * stride_kc_t, tok_mask, offs_d, d_mask, stride_kc_d)
        v = _load_rows(vc, phys * stride_vc_p + t * stride_vc_t, tok_mask, offs_d, d_mask, stride_vc_d)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s_mask = tok_mask[None, :]
        if HAS_DOC:
            s_mask = s_mask & (tok[None, :] >= doc[:, None])
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, s_mask, qk_scale, True, DOT_PREC)
    acc, m_i, l_i = _own_fwd(acc, m_i, l_i, q, k_ptr + hkv * stride_k_h, v_ptr + hkv * stride_v_h, i_q, i_lo, i_hi, doc,
                             doc_lo, C, past_len, qk_scale, offs_n, offs_d, d_mask, stride_k_c, stride_k_d, stride_v_c,
                             stride_v_d, HAS_DOC, UPCAST, DOT_PREC, BLOCK_N)
    # Every real row saw at least its own key (the diagonal), so l_i > 0; rows past the block are not stored.
    l_i = tl.where(r_mask, l_i, 1.0)
    acc = acc / l_i[:, None]
    o_off = i_q.to(tl.int64) * stride_o_c + head * stride_o_h
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :] * stride_o_d, acc.to(out_ptr.dtype.element_ty),
             mask=r_mask[:, None] & d_mask[None, :])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # natural-log units
    tl.store(lse_ptr + head * stride_lse_h + i_q, lse, mask=r_mask)


@tuned(DQ_GPU_CONFIGS, key=_KEY)
@triton.jit
def _sparse_attn_bwd_dq_kernel(
    q_ptr,  # [C, Hq, D]
    k_ptr,  # [C, Hkv, D] own keys
    v_ptr,  # [C, Hkv, D] own values
    k_cache_ptr,  # [P, S, Hkv, D]
    v_cache_ptr,  # [P, S, Hkv, D]
    block_table_ptr,  # int32 [n]
    sel_ptr,  # int32 [nb, Hkv, K]
    counts_ptr,  # int32 [nb, Hkv]
    dout_ptr,  # [C, Hq, D]
    lse_ptr,  # fp32 [Hq, C] of the whole (own + selected past) attention
    delta_ptr,  # fp32 [Hq, C]
    dq_ptr,  # [C, Hq, D] dq over the selected past and the own chunk (written, q's dtype)
    doc_ptr,  # int32 [C] (HAS_DOC only)
    C,
    past_len,
    qk_scale,
    softmax_scale,
    n_rows, n_cols,  # USE_TMA: the pools seen as [n_rows, n_cols] = [P * S, Hkv * D]
    stride_q_c, stride_q_h, stride_q_d,
    stride_k_c, stride_k_h, stride_k_d,
    stride_v_c, stride_v_h, stride_v_d,
    stride_kc_p, stride_kc_t, stride_kc_h, stride_kc_d,
    stride_vc_p, stride_vc_t, stride_vc_h, stride_vc_d,
    stride_sel_b, stride_sel_h,
    stride_cnt_b, stride_cnt_h,
    stride_do_c, stride_do_h, stride_do_d,
    stride_dq_c, stride_dq_h, stride_dq_d,
    stride_lse_h,
    stride_delta_h,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_DOC: tl.constexpr,
    USE_TMA: tl.constexpr,  # full-page tiles through tensor descriptors (see tma.use_tma)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    hkv = tl.program_id(1).to(tl.int64)
    b, row0, row_end, offs_r, i_lo, i_hi = _block_rows(tl.program_id(0), C, G, BLOCK_Q, BLOCK_M)
    r_mask = offs_r < row_end
    i_q = offs_r // G
    head = hkv * G + offs_r % G
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    q = _load_rows(q_ptr, i_q.to(tl.int64) * stride_q_c + head * stride_q_h, r_mask, offs_d, d_mask, stride_q_d)
    do = _load_rows(dout_ptr, i_q.to(tl.int64) * stride_do_c + head * stride_do_h, r_mask, offs_d, d_mask, stride_do_d)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    doc = i_q  # read only with HAS_DOC
    doc_lo = row0
    if HAS_DOC:
        doc = tl.load(doc_ptr + i_q, mask=r_mask, other=0)
        doc_lo = tl.load(doc_ptr + i_lo)
    lse2 = tl.load(lse_ptr + head * stride_lse_h + i_q, mask=r_mask, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + head * stride_delta_h + i_q, mask=r_mask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kc = k_cache_ptr + hkv * stride_kc_h
    vc = v_cache_ptr + hkv * stride_vc_h
    sel_row = sel_ptr + b * stride_sel_b + hkv * stride_sel_h
    n_cnt = tl.load(counts_ptr + b * stride_cnt_b + hkv * stride_cnt_h)
    n_virt = n_cnt * PAGE_SIZE
    u_start = 0
    if USE_TMA:
        # As in the forward: full-page tiles through descriptors; rows past the block (r_mask) have
        # q = dout = 0 and are never stored, so these tiles need no mask.
        k_desc = tl.make_tensor_descriptor(k_cache_ptr, shape=[n_rows, n_cols], strides=[n_cols, 1], block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_cache_ptr, shape=[n_rows, n_cols], strides=[n_cols, 1], block_shape=[BLOCK_N, BLOCK_D])
        col = (hkv * HEAD_DIM).to(tl.int32)
        u_start = _full_virtual_tokens(sel_row, n_cnt, past_len, PAGE_SIZE)
        for u0 in range(0, u_start, BLOCK_N):
            k, v = _page_tile(k_desc, v_desc, sel_row, block_table_ptr, u0, col, PAGE_SIZE, UPCAST)
            dq = _dq_tile(dq, q, do, k, v, lse2, delta, None, qk_scale, False, DOT_PREC)
    for u0 in range(u_start, n_virt, BLOCK_N):
        u = u0 + offs_n
        tok, phys, t, tok_mask = _selected_tokens(sel_row, block_table_ptr, u, u < n_virt, past_len, PAGE_SIZE)
        k = _load_rows(kc, phys * stride_kc_p + t * stride_kc_t, tok_mask, offs_d, d_mask, stride_kc_d)
        v = _load_rows(vc, phys * stride_vc_p + t * stride_vc_t, tok_mask, offs_d, d_mask, stride_vc_d)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s_mask = tok_mask[None, :] & r_mask[:, None]
        if HAS_DOC:
            s_mask = s_mask & (tok[None, :] >= doc[:, None])
        dq = _dq_tile(dq, q, do, k, v, lse2, delta, s_mask, qk_scale, True, DOT_PREC)
    dq = _own_dq(dq, q, do, k_ptr + hkv * stride_k_h, v_ptr + hkv * stride_v_h, lse2, delta, i_q, i_lo, i_hi, doc, doc_lo,
                 C, past_len, qk_scale, offs_n, offs_d, d_mask, stride_k_c, stride_k_d, stride_v_c, stride_v_d, HAS_DOC,
                 UPCAST, DOT_PREC, BLOCK_N)
    dq = dq * softmax_scale
    dq_off = i_q.to(tl.int64) * stride_dq_c + head * stride_dq_h
    tl.store(dq_ptr + dq_off[:, None] + offs_d[None, :] * stride_dq_d, dq.to(dq_ptr.dtype.element_ty),
             mask=r_mask[:, None] & d_mask[None, :])


@tuned(DKDV_GPU_CONFIGS, key=_DKDV_KEY, pre_hook=_DKDV_RESTORE.pre_hook, post_hook=_DKDV_RESTORE.post_hook)
@triton.jit
def _sparse_attn_bwd_dkdv_kernel(
    q_ptr,  # [C, Hq, D]
    k_cache_ptr,  # [P, S, Hkv, D]
    v_cache_ptr,  # [P, S, Hkv, D]
    block_table_ptr,  # int32 [n]
    csr_offsets_ptr,  # int32 [Hkv * n + 1]: blocks of (h, page p) are csr_blocks[off[h*n+p] : off[h*n+p+1]]
    csr_blocks_ptr,  # int32 [nnz] query blocks, ascending within each (h, p)
    work_order_ptr,  # int32 [Hkv * n] (h, p) pairs h*n+p, most-selected first
    dout_ptr,  # [C, Hq, D]
    lse_ptr,  # fp32 [Hq, C]
    delta_ptr,  # fp32 [Hq, C]
    dk_cache_ptr,  # fp32 [P, S, Hkv, D] (read-add-write of the selected pages' rows)
    dv_cache_ptr,  # fp32 [P, S, Hkv, D]
    doc_ptr,  # int32 [C] (HAS_DOC only)
    C,
    past_len,
    n_pages,
    qk_scale,
    softmax_scale,
    Hq,
    stride_q_c, stride_q_h, stride_q_d,
    stride_kc_p, stride_kc_t, stride_kc_h, stride_kc_d,
    stride_vc_p, stride_vc_t, stride_vc_h, stride_vc_d,
    stride_do_c, stride_do_h, stride_do_d,
    stride_dk_p, stride_dk_t, stride_dk_h, stride_dk_d,
    stride_dv_p, stride_dv_t, stride_dv_h, stride_dv_d,
    stride_lse_h,
    stride_delta_h,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_DOC: tl.constexpr,
    QO_TMA: tl.constexpr,  # q/dout row tiles through [Hq, C, D] tensor descriptors (see tma.qo_tma)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tiles = tl.cdiv(PAGE_SIZE, BLOCK_N)
    pid = tl.program_id(0)
    pair = tl.load(work_order_ptr + pid // tiles).to(tl.int64)
    hkv = pair // n_pages
    page = pair % n_pages
    t = (pid % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)  # slot tokens of this program
    j = page * PAGE_SIZE + t  # logical past tokens
    e_lo = tl.load(csr_offsets_ptr + hkv * n_pages + page)
    e_hi = tl.load(csr_offsets_ptr + hkv * n_pages + page + 1)
    # A page no block selected is neither read nor written (its program does nothing).
    j_mask = (t < PAGE_SIZE) & (j < past_len) & (e_hi > e_lo)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    phys = tl.load(block_table_ptr + page).to(tl.int64)
    t64 = t.to(tl.int64)
    k = _load_rows(k_cache_ptr + hkv * stride_kc_h, phys * stride_kc_p + t64 * stride_kc_t, j_mask, offs_d, d_mask, stride_kc_d)
    v = _load_rows(v_cache_ptr + hkv * stride_vc_h, phys * stride_vc_p + t64 * stride_vc_t, j_mask, offs_d, d_mask, stride_vc_d)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Rows walked head-major, as in the dense dk/dv kernel: for each selecting block, the query tiles of head 0 of the
    # group, then head 1, ...; a row tile is BLOCK_M consecutive queries of ONE head (a plain 2-D tile, or one
    # descriptor box). One flat loop over (block, head, tile), so it pipelines as one.
    N_T = (BLOCK_Q + BLOCK_M - 1) // BLOCK_M  # row tiles per (block, head)
    offs_m = tl.arange(0, BLOCK_M)
    if QO_TMA:
        q_desc = tl.make_tensor_descriptor(q_ptr, shape=[Hq, C, HEAD_DIM], strides=[stride_q_h, stride_q_c, 1],
                                           block_shape=[1, BLOCK_M, BLOCK_D])
        do_desc = tl.make_tensor_descriptor(dout_ptr, shape=[Hq, C, HEAD_DIM], strides=[stride_do_h, stride_do_c, 1],
                                            block_shape=[1, BLOCK_M, BLOCK_D])
    for it in range(0, (e_hi - e_lo) * (G * N_T)):
        e = e_lo + it // (G * N_T)
        r = it % (G * N_T)
        g = r // N_T
        b = tl.load(csr_blocks_ptr + e)
        i0 = b * BLOCK_Q + (r % N_T) * BLOCK_M
        i = i0 + offs_m
        i_mask = i < tl.minimum((b + 1) * BLOCK_Q, C)  # rows of the next block may not have selected this page
        head = hkv * G + g
        if QO_TMA:
            q = q_desc.load([head.to(tl.int32), i0, 0]).reshape([BLOCK_M, BLOCK_D])
            do = do_desc.load([head.to(tl.int32), i0, 0]).reshape([BLOCK_M, BLOCK_D])
        else:
            q = _load_rows(q_ptr + head * stride_q_h, i.to(tl.int64) * stride_q_c, i_mask, offs_d, d_mask, stride_q_d)
            do = _load_rows(dout_ptr + head * stride_do_h, i.to(tl.int64) * stride_do_c, i_mask, offs_d, d_mask, stride_do_d)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse2 = tl.load(lse_ptr + head * stride_lse_h + i, mask=i_mask, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_ptr + head * stride_delta_h + i, mask=i_mask, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # [N, M]
        p_t = tl.exp2(s_t - lse2[None, :])
        # Rows outside the block contribute exactly 0 (with descriptors their q/dout are another block's).
        p_mask = i_mask[None, :]
        if HAS_DOC:
            doc = tl.load(doc_ptr + i, mask=i_mask, other=0)
            p_mask = p_mask & (j[:, None] >= doc[None, :])
        p_t = tl.where(p_mask, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PREC)
    dk = dk * softmax_scale
    # Only pages some block selected are written; each row by exactly this program.
    st_mask = j_mask[:, None] & d_mask[None, :]
    dk_ptrs = dk_cache_ptr + hkv * stride_dk_h + (phys * stride_dk_p + t64 * stride_dk_t)[:, None] + offs_d[None, :] * stride_dk_d
    dv_ptrs = dv_cache_ptr + hkv * stride_dv_h + (phys * stride_dv_p + t64 * stride_dv_t)[:, None] + offs_d[None, :] * stride_dv_d
    dk += tl.load(dk_ptrs, mask=st_mask, other=0.0)
    dv += tl.load(dv_ptrs, mask=st_mask, other=0.0)
    tl.store(dk_ptrs, dk, mask=st_mask)
    tl.store(dv_ptrs, dv, mask=st_mask)

