"""Triton sparse paged attention: each query block reads only its selected past pages.

Same contract as :func:`oomb.ops.sparse.sparse_attention_fwd_ref` /
:func:`oomb.ops.sparse.sparse_attention_bwd_ref` (the reference every test compares against):
query block ``b`` (queries ``b*B .. b*B+B-1``) of KV head ``h`` attends to the past pages
``page_idx[b, h, :counts[b, h]]`` (logical, ascending; mapped to pool pages through
``block_table``) plus the whole own chunk, causally.

How the work is split (shape legend as in :mod:`oomb.ops.triton_paged_attention`; B queries per
selection block, K selected pages per (block, KV head), n past pages):

* The own chunk is the dense problem with no past, so it runs through the dense kernels
  (:func:`~oomb.ops.triton_paged_attention.paged_attention_fwd` /
  ``paged_attention_bwd`` with ``past_len=0``). The forward then merges the own and the past
  partial results through their log-sum-exps (FlashAttention's rescaling, in torch: a few
  [C, Hq, D] passes, ~2% of the attention's time at C=4096 and 64 selected pages); the dq
  kernel's past part is added to the own part.
* Forward and dq (past part): one program per (row tile of ONE query block, KV head). Rows are
  the dense kernels' query-major (query, head-in-group) pairs, so a tile holds all G heads of
  its queries and shares each K/V tile among them; a tile never straddles two query blocks.
  The block's selected pages are walked as one virtual token sequence ``u = slot * S + t``
  (page ``page_idx[b, h, slot]``, slot token ``t``) in ``BLOCK_N`` tiles, so a tile may span
  several selected pages or part of one, whatever ``page_size``.
* dK/dV (past): one program per (past page, token tile of it, KV head), which loops over the
  query blocks that selected the page -- an inverse (CSR) map the launcher builds from
  ``page_idx`` -- and over their row tiles, in ascending order, then does ONE read-add-write
  of its gradient-page rows. Pages no block selected are not touched. As in the dense kernels,
  no atomics: the result is bitwise reproducible. Programs are launched most-selected page
  first (longest-processing-time order): the sink and local pages, which every block selects,
  would otherwise be among the last launched and finish alone.

Rows that see no past key (no page selected, or packed documents) give ``out_past = 0`` and
``lse_past = -inf``, and merge to the own-chunk result.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .sparse import PageSelection
from .triton_paged_attention import (
    _INTERPRET,
    _LOG2E,
    _PRUNE,
    _alloc,
    _check_doc,
    _check_inputs,
    _configs,
    _dot_precision,
    _dq_tile,
    _drain_streams_before_first_tune,
    _RestoreRows,
    _fwd_tile,
    _load_rows,
    paged_attention_bwd,
    paged_attention_fwd,
)

__all__ = ["sparse_attention_fwd", "sparse_attention_bwd"]

_FWD_CONFIGS = _configs([(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)])
_DQ_CONFIGS = _configs([(128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3)])
_DKDV_CONFIGS = _configs([(64, 128, 8, 3), (64, 64, 4, 3), (32, 128, 8, 2)])
_KEY = ["G", "HEAD_DIM", "PAGE_SIZE", "BLOCK_Q", "HAS_DOC"]


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


_DKDV_RESTORE = _RestoreRows(("dk_cache_ptr", "dv_cache_ptr"), _dkdv_rows)


# --------------------------------------------------------------------------------------
# Kernels (private). They check nothing: the launchers validate every input.
# --------------------------------------------------------------------------------------


@triton.jit
def _block_rows(pid, C, G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program -> (query block b, first row, end row of the block, rows [BLOCK_M])."""
    tiles = tl.cdiv(BLOCK_Q * G, BLOCK_M)
    b = pid // tiles
    row0 = b * BLOCK_Q * G + (pid % tiles) * BLOCK_M
    row_end = tl.minimum((b + 1) * BLOCK_Q, C) * G
    return b, row0, row_end, row0 + tl.arange(0, BLOCK_M)


@triton.jit
def _selected_tokens(sel_row_ptr, block_table_ptr, u, u_mask, past_len, PAGE_SIZE: tl.constexpr):
    """Virtual tokens u of a block's selection -> (logical token, pool page (int64), slot token, mask)."""
    logical = tl.load(sel_row_ptr + u // PAGE_SIZE, mask=u_mask, other=0)
    phys = tl.load(block_table_ptr + logical, mask=u_mask, other=0).to(tl.int64)
    t = u % PAGE_SIZE
    tok = logical * PAGE_SIZE + t
    return tok, phys, t.to(tl.int64), u_mask & (tok < past_len)


@triton.autotune(configs=_FWD_CONFIGS, key=_KEY, prune_configs_by=_PRUNE, cache_results=True)
@triton.jit
def _sparse_attn_fwd_kernel(
    q_ptr,  # [C, Hq, D]
    k_cache_ptr,  # [P, S, Hkv, D]
    v_cache_ptr,  # [P, S, Hkv, D]
    block_table_ptr,  # int32 [n] logical past page -> pool page
    sel_ptr,  # int32 [nb, Hkv, K] selected logical pages (ascending)
    counts_ptr,  # int32 [nb, Hkv]
    out_ptr,  # fp32 [C, Hq, D] attention over the selected past only
    lse_ptr,  # fp32 [Hq, C] its log-sum-exp (-inf where nothing is visible)
    doc_ptr,  # int32 [C] (HAS_DOC only)
    C,
    past_len,
    qk_scale,  # softmax_scale * log2(e)
    stride_q_c, stride_q_h, stride_q_d,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    hkv = tl.program_id(1).to(tl.int64)
    b, row0, row_end, offs_r = _block_rows(tl.program_id(0), C, G, BLOCK_Q, BLOCK_M)
    r_mask = offs_r < row_end
    i_q = offs_r // G
    head = hkv * G + offs_r % G
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    q = _load_rows(q_ptr, i_q.to(tl.int64) * stride_q_c + head * stride_q_h, r_mask, offs_d, d_mask, stride_q_d)
    if UPCAST:
        q = q.to(tl.float32)
    if HAS_DOC:
        doc = tl.load(doc_ptr + i_q, mask=r_mask, other=0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kc = k_cache_ptr + hkv * stride_kc_h
    vc = v_cache_ptr + hkv * stride_vc_h
    sel_row = sel_ptr + b * stride_sel_b + hkv * stride_sel_h
    n_virt = tl.load(counts_ptr + b * stride_cnt_b + hkv * stride_cnt_h) * PAGE_SIZE
    for u0 in range(0, n_virt, BLOCK_N):
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
    seen = l_i > 0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_off = i_q.to(tl.int64) * stride_o_c + head * stride_o_h
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :] * stride_o_d, acc, mask=r_mask[:, None] & d_mask[None, :])
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + head * stride_lse_h + i_q, lse, mask=r_mask)


@triton.autotune(configs=_DQ_CONFIGS, key=_KEY, prune_configs_by=_PRUNE, cache_results=True)
@triton.jit
def _sparse_attn_bwd_dq_kernel(
    q_ptr,  # [C, Hq, D]
    k_cache_ptr,  # [P, S, Hkv, D]
    v_cache_ptr,  # [P, S, Hkv, D]
    block_table_ptr,  # int32 [n]
    sel_ptr,  # int32 [nb, Hkv, K]
    counts_ptr,  # int32 [nb, Hkv]
    dout_ptr,  # [C, Hq, D]
    lse_ptr,  # fp32 [Hq, C] of the whole (own + selected past) attention
    delta_ptr,  # fp32 [Hq, C]
    dq_ptr,  # fp32 [C, Hq, D] past part of dq (written)
    doc_ptr,  # int32 [C] (HAS_DOC only)
    C,
    past_len,
    qk_scale,
    softmax_scale,
    stride_q_c, stride_q_h, stride_q_d,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    hkv = tl.program_id(1).to(tl.int64)
    b, row0, row_end, offs_r = _block_rows(tl.program_id(0), C, G, BLOCK_Q, BLOCK_M)
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
    if HAS_DOC:
        doc = tl.load(doc_ptr + i_q, mask=r_mask, other=0)
    lse2 = tl.load(lse_ptr + head * stride_lse_h + i_q, mask=r_mask, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + head * stride_delta_h + i_q, mask=r_mask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kc = k_cache_ptr + hkv * stride_kc_h
    vc = v_cache_ptr + hkv * stride_vc_h
    sel_row = sel_ptr + b * stride_sel_b + hkv * stride_sel_h
    n_virt = tl.load(counts_ptr + b * stride_cnt_b + hkv * stride_cnt_h) * PAGE_SIZE
    for u0 in range(0, n_virt, BLOCK_N):
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
    dq = dq * softmax_scale
    dq_off = i_q.to(tl.int64) * stride_dq_c + head * stride_dq_h
    tl.store(dq_ptr + dq_off[:, None] + offs_d[None, :] * stride_dq_d, dq, mask=r_mask[:, None] & d_mask[None, :])


@triton.autotune(configs=_DKDV_CONFIGS, key=_KEY, pre_hook=_DKDV_RESTORE.pre_hook, post_hook=_DKDV_RESTORE.post_hook, prune_configs_by=_PRUNE, cache_results=True)
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
    for e in range(e_lo, e_hi):
        b = tl.load(csr_blocks_ptr + e)
        row_end = tl.minimum((b + 1) * BLOCK_Q, C) * G
        for row0 in range(b * BLOCK_Q * G, row_end, BLOCK_M):
            offs_r = row0 + tl.arange(0, BLOCK_M)
            r_mask = offs_r < row_end  # rows of the next block may not have selected this page
            i_q = offs_r // G
            head = hkv * G + offs_r % G
            # Masked rows read q = dout = lse = delta = 0 and contribute exactly 0.
            q = _load_rows(q_ptr, i_q.to(tl.int64) * stride_q_c + head * stride_q_h, r_mask, offs_d, d_mask, stride_q_d)
            do = _load_rows(dout_ptr, i_q.to(tl.int64) * stride_do_c + head * stride_do_h, r_mask, offs_d, d_mask, stride_do_d)
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse2 = tl.load(lse_ptr + head * stride_lse_h + i_q, mask=r_mask, other=0.0) * 1.4426950408889634
            delta = tl.load(delta_ptr + head * stride_delta_h + i_q, mask=r_mask, other=0.0)
            s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # [N, M]
            p_t = tl.exp2(s_t - lse2[None, :])
            if HAS_DOC:
                doc = tl.load(doc_ptr + i_q, mask=r_mask, other=0)
                p_t = tl.where(j[:, None] >= doc[None, :], p_t, 0.0)
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


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------


def _check_selection(sel: PageSelection, C: int, Hkv: int, past_len: int, page_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a selection -> contiguous int32 (page_idx [nb, Hkv, K], counts [nb, Hkv]) on ``device``."""
    if not isinstance(sel, PageSelection):
        raise ValueError(f"sel must be a PageSelection, got {type(sel).__name__}")
    nb = -(-C // sel.block_size)
    n = -(-past_len // page_size) if past_len > 0 else 0
    if sel.page_idx.dim() != 3 or sel.page_idx.shape[:2] != (nb, Hkv) or sel.counts.shape != (nb, Hkv):
        raise ValueError(
            f"selection page_idx {tuple(sel.page_idx.shape)} / counts {tuple(sel.counts.shape)} do not match "
            f"{nb} query blocks of {sel.block_size} and {Hkv} KV heads"
        )
    if sel.page_idx.dtype != torch.int32 or sel.counts.dtype != torch.int32:
        raise ValueError(f"selection tensors must be int32; got {sel.page_idx.dtype}, {sel.counts.dtype}")
    if sel.page_idx.device != device or sel.counts.device != device:
        raise ValueError(f"selection tensors must be on {device}")
    if sel.page_idx.shape[2] > 0 and sel.n_past_pages != n:
        raise ValueError(f"selection made for {sel.n_past_pages} past pages, the past has {n}")
    return sel.page_idx.contiguous(), sel.counts.contiguous()


def _common(q, sel, D, page_size, doc):
    return dict(G=q.shape[1] // sel.page_idx.shape[1], HEAD_DIM=D, PAGE_SIZE=page_size, BLOCK_Q=sel.block_size,
                BLOCK_D=max(16, triton.next_power_of_2(D)), UPCAST=_INTERPRET, DOT_PREC=_dot_precision(q.dtype),
                HAS_DOC=doc is not None)


def _has_past(sel: PageSelection, past_len: int) -> bool:
    return past_len > 0 and sel.page_idx.shape[2] > 0


def sparse_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor | None,
    past_len: int,
    sel: PageSelection,
    softmax_scale: float | None = None,
    q_doc_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one chunk over its selected past pages plus its own K/V (causal).

    Args:
        q: [C, Hq, D]; k, v: [C, Hkv, D] (bf16/fp16/fp32, any strides).
        k_cache, v_cache: [P, S, Hkv, D] in q's dtype; block_table: int32 [>= n] logical -> pool page.
        past_len: past tokens; sel: :class:`~oomb.ops.sparse.PageSelection` (int32, on q's device)
            made for ceil(past_len / S) past pages; softmax_scale: default 1/sqrt(D);
        q_doc_start: optional int [C] (packed documents, as in the dense kernels).

    Returns:
        out [C, Hq, D] in q's dtype (contiguous); lse [Hq, C] float32.

    Raises:
        ValueError: as :func:`~oomb.ops.triton_paged_attention.paged_attention_fwd`, plus a
            selection of the wrong shape, dtype or device.
    """
    C, Hq, Hkv, D, page_size, scale = _check_inputs(q, k, v, k_cache, v_cache, block_table, past_len, softmax_scale)
    page_idx, counts = _check_selection(sel, C, Hkv, past_len, page_size, q.device)
    doc = _check_doc(q_doc_start, C, past_len, q.device)
    out_own, lse_own = paged_attention_fwd(q, k, v, None, None, None, 0, scale, q_doc_start=_shift(doc, past_len))
    if not _has_past(sel, past_len) or C == 0:
        return out_own, lse_own
    out_p = _alloc((C, Hq, D), torch.float32, q.device)
    lse_p = _alloc((Hq, C), torch.float32, q.device)
    nb = page_idx.shape[0]
    bt = block_table.contiguous()

    def grid(meta):
        return (nb * triton.cdiv(sel.block_size * (Hq // Hkv), meta["BLOCK_M"]), Hkv)

    skc, svc = k_cache.stride(), v_cache.stride()
    _sparse_attn_fwd_kernel[grid](
        q_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache, block_table_ptr=bt, sel_ptr=page_idx, counts_ptr=counts,
        out_ptr=out_p, lse_ptr=lse_p, doc_ptr=doc if doc is not None else bt,
        C=C, past_len=past_len, qk_scale=scale * _LOG2E,
        stride_q_c=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        stride_kc_p=skc[0], stride_kc_t=skc[1], stride_kc_h=skc[2], stride_kc_d=skc[3],
        stride_vc_p=svc[0], stride_vc_t=svc[1], stride_vc_h=svc[2], stride_vc_d=svc[3],
        stride_sel_b=page_idx.stride(0), stride_sel_h=page_idx.stride(1),
        stride_cnt_b=counts.stride(0), stride_cnt_h=counts.stride(1),
        stride_o_c=out_p.stride(0), stride_o_h=out_p.stride(1), stride_o_d=out_p.stride(2),
        stride_lse_h=lse_p.stride(0),
        **_common(q, sel, D, page_size, doc),
    )
    # Merge the own-chunk and selected-past partial softmaxes (lse_own is finite: the diagonal).
    lse = torch.logaddexp(lse_own, lse_p)
    w_own = torch.exp(lse_own - lse).t()[..., None]  # [C, Hq, 1]
    w_past = torch.exp(lse_p - lse).t()[..., None]
    out = (out_own.float() * w_own + out_p * w_past).to(q.dtype)
    return out, lse


def _shift(doc: torch.Tensor | None, past_len: int) -> torch.Tensor | None:
    """Document starts relative to the own chunk (the dense kernel then sees past_len = 0)."""
    return None if doc is None else (doc - past_len).clamp(min=0)


def _inverse_selection(page_idx: torch.Tensor, n_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """page_idx [nb, Hkv, K] -> CSR of the query blocks that selected each (KV head, page).

    Returns offsets int32 [Hkv * n + 1] and blocks int32 [nb * Hkv * K]: the blocks of (h, p) are
    ``blocks[offsets[h*n + p] : offsets[h*n + p + 1]]``, ascending (entries past ``offsets[-1]``
    are unused). No host synchronisation: sizes are fixed by the selection's shape.
    """
    nb, Hkv, K = page_idx.shape
    dev = page_idx.device
    b = torch.arange(nb, device=dev, dtype=torch.int64)[:, None, None]
    h = torch.arange(Hkv, device=dev, dtype=torch.int64)[None, :, None]
    valid = page_idx >= 0
    key = (h * n_pages + page_idx.long()) * nb + b  # sorts by (head, page, block)
    key = torch.where(valid, key, Hkv * n_pages * nb).flatten()
    blocks = (torch.sort(key).values % nb).to(torch.int32)
    per = torch.zeros(Hkv * n_pages + 1, dtype=torch.int64, device=dev)
    per.index_add_(0, torch.where(valid, h * n_pages + page_idx.long(), Hkv * n_pages).flatten(), torch.ones_like(key))
    offsets = torch.zeros(Hkv * n_pages + 1, dtype=torch.int32, device=dev)
    offsets[1:] = per[:-1].cumsum(0).to(torch.int32)
    return offsets, blocks


def sparse_attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor | None,
    past_len: int,
    dk_cache: torch.Tensor | None,
    dv_cache: torch.Tensor | None,
    sel: PageSelection,
    softmax_scale: float | None = None,
    q_doc_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`sparse_attention_fwd`; adds the selected past pages' dK/dV in place.

    Args:
        as :func:`~oomb.ops.triton_paged_attention.paged_attention_bwd`, plus ``sel``.
        dk_cache, dv_cache: float32 [P, S, Hkv, D]; only rows of selected pages (below past_len)
            change, deterministically (no atomics).

    Returns:
        dq [C, Hq, D] in q's dtype; dk, dv [C, Hkv, D] in k's dtype (own chunk's contribution only).
    """
    C, Hq, Hkv, D, page_size, scale = _check_inputs(q, k, v, k_cache, v_cache, block_table, past_len, softmax_scale)
    page_idx, counts = _check_selection(sel, C, Hkv, past_len, page_size, q.device)
    doc = _check_doc(q_doc_start, C, past_len, q.device)
    has_past = _has_past(sel, past_len) and C > 0
    if has_past:
        for name, t in (("dk_cache", dk_cache), ("dv_cache", dv_cache)):
            if t is None or t.shape != k_cache.shape or t.dtype != torch.float32 or t.device != q.device:
                raise ValueError(f"a selection with past pages needs {name} float32 {tuple(k_cache.shape)} on {q.device}")
    # Own chunk: the dense kernels with no past (they use the full lse and delta, so this is exact).
    dq_own, dk, dv = paged_attention_bwd(dout, q, k, v, out, lse, None, None, None, 0, None, None, scale,
                                         q_doc_start=_shift(doc, past_len))
    if not has_past:
        return dq_own, dk, dv
    delta = (dout.float() * out.float()).sum(-1).t().contiguous()
    bt = block_table.contiguous()
    doc_arg = doc if doc is not None else bt
    common = _common(q, sel, D, page_size, doc)
    nb = page_idx.shape[0]
    skc, svc = k_cache.stride(), v_cache.stride()
    dq_p = _alloc((C, Hq, D), torch.float32, q.device)

    def grid_rows(meta):
        return (nb * triton.cdiv(sel.block_size * (Hq // Hkv), meta["BLOCK_M"]), Hkv)

    _sparse_attn_bwd_dq_kernel[grid_rows](
        q_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache, block_table_ptr=bt, sel_ptr=page_idx, counts_ptr=counts,
        dout_ptr=dout, lse_ptr=lse, delta_ptr=delta, dq_ptr=dq_p, doc_ptr=doc_arg,
        C=C, past_len=past_len, qk_scale=scale * _LOG2E, softmax_scale=scale,
        stride_q_c=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        stride_kc_p=skc[0], stride_kc_t=skc[1], stride_kc_h=skc[2], stride_kc_d=skc[3],
        stride_vc_p=svc[0], stride_vc_t=svc[1], stride_vc_h=svc[2], stride_vc_d=svc[3],
        stride_sel_b=page_idx.stride(0), stride_sel_h=page_idx.stride(1),
        stride_cnt_b=counts.stride(0), stride_cnt_h=counts.stride(1),
        stride_do_c=dout.stride(0), stride_do_h=dout.stride(1), stride_do_d=dout.stride(2),
        stride_dq_c=dq_p.stride(0), stride_dq_h=dq_p.stride(1), stride_dq_d=dq_p.stride(2),
        stride_lse_h=lse.stride(0), stride_delta_h=delta.stride(0),
        **common,
    )
    n_pages = sel.n_past_pages
    offsets, blocks = _inverse_selection(page_idx, n_pages)

    # Longest work first: sink and local pages are selected by every block, and launched last (as
    # their page order would) they would run alone at the end of the kernel.
    per_pair = (offsets[1:] - offsets[:-1]).to(torch.int64)
    work_order = torch.sort(per_pair, descending=True, stable=True).indices.to(torch.int32)

    def grid_pages(meta):
        return (Hkv * n_pages * triton.cdiv(page_size, meta["BLOCK_N"]),)

    sdk, sdv = dk_cache.stride(), dv_cache.stride()
    _drain_streams_before_first_tune("sparse_dkdv", q, common)
    _sparse_attn_bwd_dkdv_kernel[grid_pages](
        q_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache, block_table_ptr=bt, csr_offsets_ptr=offsets,
        csr_blocks_ptr=blocks, work_order_ptr=work_order, dout_ptr=dout, lse_ptr=lse, delta_ptr=delta,
        dk_cache_ptr=dk_cache, dv_cache_ptr=dv_cache, doc_ptr=doc_arg,
        C=C, past_len=past_len, n_pages=n_pages, qk_scale=scale * _LOG2E, softmax_scale=scale,
        stride_q_c=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        stride_kc_p=skc[0], stride_kc_t=skc[1], stride_kc_h=skc[2], stride_kc_d=skc[3],
        stride_vc_p=svc[0], stride_vc_t=svc[1], stride_vc_h=svc[2], stride_vc_d=svc[3],
        stride_do_c=dout.stride(0), stride_do_h=dout.stride(1), stride_do_d=dout.stride(2),
        stride_dk_p=sdk[0], stride_dk_t=sdk[1], stride_dk_h=sdk[2], stride_dk_d=sdk[3],
        stride_dv_p=sdv[0], stride_dv_t=sdv[1], stride_dv_h=sdv[2], stride_dv_d=sdv[3],
        stride_lse_h=lse.stride(0), stride_delta_h=delta.stride(0),
        **common,
    )
    dq = (dq_own.float() + dq_p).to(q.dtype)
    return dq, dk, dv
