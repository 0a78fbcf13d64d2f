"""Backward kernels of the Triton paged attention: dq, and dk/dv with in-place paged KV-gradient accumulation
(FlashAttention-2 §3.2: recomputation from the log-sum-exp and ``delta = rowsum(dout * out)``).

* dq: one program per (row tile, KV head), looping over past and own key tiles.
* dk/dv: one program per (key tile, KV head), looping over every row tile that sees it; for past tiles it reads
  the fp32 gradient pages, adds its sum and writes them back (one read-add-write per row, no atomics); for the
  own chunk it writes ``dk``/``dv``.

Contract, layout, and why the schedule is deterministic: :mod:`oomb.ops.triton.paged_attention`, whose launcher
validates every input (the kernels check nothing).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .autotune import AUTOTUNE_KEY, RestoreRows, tuned
from .tiles import _dq_tile, _load_rows, _past_from, _past_token_offsets

__all__ = ["DKDV5_GPU_CONFIGS", "DQ_GPU_CONFIGS", "_paged_attn_bwd_dkdv5_kernel", "_paged_attn_bwd_dq_kernel"]

DQ_GPU_CONFIGS = [(128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3)]
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) the dq kernel is autotuned over on a GPU."""


def _dkdv5_rows(nargs: dict):
    """Pool pages a dense dK/dV launch writes: those of keys [key_start, n_keys) through the block table (past), or
    None (the whole, one-chunk own-gradient tensor)."""
    if not nargs["IS_PAST"]:
        return None
    S = nargs["PAGE_SIZE"]
    lo, hi = int(nargs["key_start"]) // S, -(-int(nargs["n_keys"]) // S)
    return nargs["block_table_ptr"][lo:hi].long().unique()


_DKDV5_RESTORE = RestoreRows(("dk_ptr", "dv_ptr"), _dkdv5_rows)


@tuned(DQ_GPU_CONFIGS, key=AUTOTUNE_KEY + ["USE_TMA"])
@triton.jit
def _paged_attn_bwd_dq_kernel(
    q_ptr,  # [C, Hq, D]
    k_ptr,  # [C, Hkv, D]
    v_ptr,  # [C, Hkv, D]
    k_cache_ptr,  # [P, S, Hkv, D]
    v_cache_ptr,  # [P, S, Hkv, D]
    block_table_ptr,  # int32
    dout_ptr,  # [C, Hq, D]
    lse_ptr,  # fp32 [Hq, C]
    delta_ptr,  # fp32 [Hq, C]
    dq_ptr,  # [C, Hq, D]
    doc_ptr,  # int32 [C] (HAS_DOC only)
    C,
    past_start,
    past_len,
    qk_scale,  # softmax_scale * log2(e)
    softmax_scale,
    n_rows, n_cols,  # USE_TMA: the pools seen as [n_rows, n_cols] = [P * S, Hkv * D]
    stride_q_c, stride_q_h, stride_q_d,
    stride_k_c, stride_k_h, stride_k_d,
    stride_v_c, stride_v_h, stride_v_d,
    stride_kc_p, stride_kc_t, stride_kc_h, stride_kc_d,
    stride_vc_p, stride_vc_t, stride_vc_h, stride_vc_d,
    stride_do_c, stride_do_h, stride_do_d,
    stride_dq_c, stride_dq_h, stride_dq_d,
    stride_lse_h,
    stride_delta_h,
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
    offs_r = row0 + tl.arange(0, BLOCK_M)
    r_mask = offs_r < C * G
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
    lse2 = tl.load(lse_ptr + head * stride_lse_h + i_q, mask=r_mask, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + head * stride_delta_h + i_q, mask=r_mask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    kc = k_cache_ptr + hkv * stride_kc_h
    vc = v_cache_ptr + hkv * stride_vc_h
    past_start = _past_from(past_start, PART)
    n_full = past_start + ((past_len - past_start) // BLOCK_N) * BLOCK_N
    past_end = past_len
    if HAS_DOC:
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
            dq = _dq_tile(dq, q, do, k, v, lse2, delta, s_mask, qk_scale, True, DOT_PREC)
        n_full = 0
        past_end = 0
    if USE_TMA:
        # As in the forward: one page lookup and one box per full tile.
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
            dq = _dq_tile(dq, q, do, k, v, lse2, delta, None, qk_scale, False, DOT_PREC)
    else:
        for start in range(past_start, n_full, BLOCK_N):
            tok = start + offs_n
            tok_mask = tok < past_len
            k = _load_rows(kc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_kc_p, stride_kc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_kc_d)
            v = _load_rows(vc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_vc_p, stride_vc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_vc_d)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            dq = _dq_tile(dq, q, do, k, v, lse2, delta, None, qk_scale, False, DOT_PREC)
    if n_full < past_end:
        tok = n_full + offs_n
        tok_mask = tok < past_len
        k = _load_rows(kc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_kc_p, stride_kc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_kc_d)
        v = _load_rows(vc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_vc_p, stride_vc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_vc_d)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        dq = _dq_tile(dq, q, do, k, v, lse2, delta, tok_mask[None, :], qk_scale, True, DOT_PREC)

    if HAS_OWN:
        i_lo = row0 // G
        i_hi = tl.minimum((row0 + BLOCK_M - 1) // G, C - 1)
        own_full = ((i_lo + 1) // BLOCK_N) * BLOCK_N
        ko = k_ptr + hkv * stride_k_h
        vo = v_ptr + hkv * stride_v_h
        own_masked_start = own_full
        if HAS_DOC:
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
            dq = _dq_tile(dq, q, do, k, v, lse2, delta, None, qk_scale, False, DOT_PREC)
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
            dq = _dq_tile(dq, q, do, k, v, lse2, delta, s_mask, qk_scale, True, DOT_PREC)

    dq = dq * softmax_scale
    dq_off = i_q.to(tl.int64) * stride_dq_c + head * stride_dq_h
    tl.store(dq_ptr + dq_off[:, None] + offs_d[None, :] * stride_dq_d, dq.to(dq_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


# dk/dv: rows walked head-major (all query tiles of head 0 of the group, then head 1, ...).
# A row tile is then BLOCK_M consecutive queries of ONE head: q/dout are plain strided 2-D tiles
# (one base pointer per tile, no per-row div/mod by G and no per-row int64 head offsets), and
# lse/delta, stored [Hq, C], are one contiguous vector load each. It replaced a walk over the
# row-interleaved (query-major) rows of the forward and dq kernels with the same per-tile arithmetic
# (only the fp32 summation order over the rows differed), which was 1.5x slower: H200, Qwen2.5-7B
# shape, 13.1 -> 8.7 ms at 32K past (docs/performance.md, "Kernels"; the "5" in the names below names this walk
# in those results and in profiles).
# It holds two fp32 [BLOCK_N, D] accumulators plus its K/V tile, so 8 warps. Only BLOCK_M=64,
# BLOCK_N=128 is kept: 32x128x4 warps and 128x128x8 warps were 2.7x / 3.2x slower there.
DKDV5_GPU_CONFIGS = [(64, 128, 8, 3), (64, 128, 8, 4), (64, 128, 8, 2)]


@triton.jit
def _dkdv5_tile(dk, dv, k, v, q_ptr, do_ptr, q_desc, do_desc, head, lse_ptr, delta_ptr, doc_ptr, key_off, i0, C, j, offs_m, offs_d,
                d_mask, qk_scale, stride_q_c, stride_q_d, stride_do_c, stride_do_d,
                CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
                QO_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """dk/dv [N, D] += contributions of queries [i0, i0 + BLOCK_M) of one head (pointers already at that head;
    with QO_TMA q/dout come from the [Hq, C, D] descriptors at ``head`` instead)."""
    i = i0 + offs_m
    i_mask = i < C
    # Rows past C read q = dout = lse = delta = 0 and so contribute exactly 0 (the descriptors
    # zero-fill rows outside [0, C) too).
    if QO_TMA:
        q = q_desc.load([head, i0, 0]).reshape([BLOCK_M, BLOCK_D])
        do = do_desc.load([head, i0, 0]).reshape([BLOCK_M, BLOCK_D])
    else:
        q = _load_rows(q_ptr, i.to(tl.int64) * stride_q_c, i_mask, offs_d, d_mask, stride_q_d)
        do = _load_rows(do_ptr, i.to(tl.int64) * stride_do_c, i_mask, offs_d, d_mask, stride_do_d)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = tl.load(lse_ptr + i, mask=i_mask, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + i, mask=i_mask, other=0.0)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # [N, M] (transposed scores)
    p_t = tl.exp2(s_t - lse2[None, :])
    if CAUSAL:
        p_t = tl.where(j[:, None] <= i[None, :], p_t, 0.0)
    if HAS_DOC:
        doc = tl.load(doc_ptr + i, mask=i_mask, other=0)
        p_t = tl.where((key_off + j)[:, None] >= doc[None, :], p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PREC)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _dkdv5_loop(dk, dv, k, v, q_ptr, do_ptr, q_desc, do_desc, lse_ptr, delta_ptr, doc_ptr, key_off, i_lo, n_t, C, j, hkv, offs_m,
                offs_d, d_mask, qk_scale, stride_q_c, stride_q_h, stride_q_d, stride_do_c, stride_do_h, stride_do_d, stride_lse_h,
                stride_delta_h, G: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr, UPCAST: tl.constexpr,
                DOT_PREC: tl.constexpr, QO_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Query tiles [i_lo + t * BLOCK_M) for t < n_t, of each of the G heads in turn: one flat loop (pipelines as one)."""
    for t in range(0, G * n_t):
        g = t // n_t
        i0 = i_lo + (t - g * n_t) * BLOCK_M
        head = hkv * G + g  # int64
        dk, dv = _dkdv5_tile(dk, dv, k, v, q_ptr + head * stride_q_h, do_ptr + head * stride_do_h, q_desc, do_desc,
                             head.to(tl.int32), lse_ptr + head * stride_lse_h, delta_ptr + head * stride_delta_h, doc_ptr,
                             key_off, i0, C, j, offs_m, offs_d, d_mask, qk_scale, stride_q_c, stride_q_d, stride_do_c,
                             stride_do_d, CAUSAL, HAS_DOC, UPCAST, DOT_PREC, QO_TMA, BLOCK_M, BLOCK_D)
    return dk, dv


# Autotuning runs the kernel once per config; the gradient pages must not keep those sums (_DKDV5_RESTORE).
@tuned(DKDV5_GPU_CONFIGS, key=[k for k in AUTOTUNE_KEY if k != "HAS_OWN"] + ["IS_PAST", "QO_TMA"],
       pre_hook=_DKDV5_RESTORE.pre_hook, post_hook=_DKDV5_RESTORE.post_hook)
@triton.jit
def _paged_attn_bwd_dkdv5_kernel(
    q_ptr,  # [C, Hq, D]
    k_ptr,  # IS_PAST: k_cache [P, S, Hkv, D]; else own k [C, Hkv, D]
    v_ptr,  # same layout as k_ptr
    block_table_ptr,  # int32 (IS_PAST only)
    dout_ptr,  # [C, Hq, D]
    lse_ptr,  # fp32 [Hq, C]
    delta_ptr,  # fp32 [Hq, C]
    dk_ptr,  # IS_PAST: fp32 dk_cache [P, S, Hkv, D] (read-add-write); else dk [C, Hkv, D] (write)
    dv_ptr,  # same layout as dk_ptr
    doc_ptr,  # int32 [C] (HAS_DOC only)
    C,
    key_start,  # first key of this launch: past_start (IS_PAST) or 0
    n_keys,  # end of the keys: past_len (IS_PAST) or C
    key_off,  # absolute token of key 0: 0 (IS_PAST) or past_len
    qk_scale,  # softmax_scale * log2(e)
    softmax_scale,
    Hq,
    stride_q_c, stride_q_h, stride_q_d,
    stride_k_p, stride_k_t, stride_k_h, stride_k_d,  # own k: stride_k_p unused, stride_k_t = token stride
    stride_v_p, stride_v_t, stride_v_h, stride_v_d,
    stride_do_c, stride_do_h, stride_do_d,
    stride_dk_p, stride_dk_t, stride_dk_h, stride_dk_d,
    stride_dv_p, stride_dv_t, stride_dv_h, stride_dv_d,
    stride_lse_h,
    stride_delta_h,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_PAST: tl.constexpr,
    PART: tl.constexpr,  # key_start > 0
    QO_TMA: tl.constexpr,  # q/dout row tiles through [Hq, C, D] tensor descriptors (see tma.qo_tma)
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_DOC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    hkv = tl.program_id(1).to(tl.int64)
    j0 = _past_from(key_start, PART) + pid_n * BLOCK_N
    j = j0 + tl.arange(0, BLOCK_N)  # key tokens owned by this program
    j_mask = j < n_keys
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_m = tl.arange(0, BLOCK_M)
    if IS_PAST:
        k_off = _past_token_offsets(block_table_ptr, j, j_mask, stride_k_p, stride_k_t, PAGE_SIZE)
        v_off = _past_token_offsets(block_table_ptr, j, j_mask, stride_v_p, stride_v_t, PAGE_SIZE)
    else:
        k_off = j.to(tl.int64) * stride_k_t
        v_off = j.to(tl.int64) * stride_v_t
    # Keys past n_keys read 0; their rows are never stored.
    k = _load_rows(k_ptr + hkv * stride_k_h, k_off, j_mask, offs_d, d_mask, stride_k_d)
    v = _load_rows(v_ptr + hkv * stride_v_h, v_off, j_mask, offs_d, d_mask, stride_v_d)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    n_tiles = tl.cdiv(C, BLOCK_M)
    if QO_TMA:
        q_desc = tl.make_tensor_descriptor(q_ptr, shape=[Hq, C, HEAD_DIM], strides=[stride_q_h, stride_q_c, 1],
                                           block_shape=[1, BLOCK_M, BLOCK_D])
        do_desc = tl.make_tensor_descriptor(dout_ptr, shape=[Hq, C, HEAD_DIM], strides=[stride_do_h, stride_do_c, 1],
                                            block_shape=[1, BLOCK_M, BLOCK_D])
    else:
        q_desc = q_ptr
        do_desc = dout_ptr
    if IS_PAST:
        # Every query of the chunk sees every past token (without packed documents): no causal mask.
        dk, dv = _dkdv5_loop(dk, dv, k, v, q_ptr, dout_ptr, q_desc, do_desc, lse_ptr, delta_ptr, doc_ptr, key_off, 0, n_tiles, C, j, hkv,
                             offs_m, offs_d, d_mask, qk_scale, stride_q_c, stride_q_h, stride_q_d,
                             stride_do_c, stride_do_h, stride_do_d, stride_lse_h, stride_delta_h,
                             G, False, HAS_DOC, UPCAST, DOT_PREC, QO_TMA, BLOCK_M, BLOCK_D)
    else:
        # Queries i >= j0 see this tile; query tiles starting at or after its last key need no mask.
        t_lo = j0 // BLOCK_M
        t_mid = tl.minimum(tl.cdiv(j0 + BLOCK_N - 1, BLOCK_M), n_tiles)
        dk, dv = _dkdv5_loop(dk, dv, k, v, q_ptr, dout_ptr, q_desc, do_desc, lse_ptr, delta_ptr, doc_ptr, key_off, t_lo * BLOCK_M, t_mid - t_lo, C, j,
                             hkv, offs_m, offs_d, d_mask, qk_scale, stride_q_c, stride_q_h, stride_q_d,
                             stride_do_c, stride_do_h, stride_do_d, stride_lse_h, stride_delta_h,
                             G, True, HAS_DOC, UPCAST, DOT_PREC, QO_TMA, BLOCK_M, BLOCK_D)
        dk, dv = _dkdv5_loop(dk, dv, k, v, q_ptr, dout_ptr, q_desc, do_desc, lse_ptr, delta_ptr, doc_ptr, key_off, t_mid * BLOCK_M, n_tiles - t_mid, C, j,
                             hkv, offs_m, offs_d, d_mask, qk_scale, stride_q_c, stride_q_h, stride_q_d,
                             stride_do_c, stride_do_h, stride_do_d, stride_lse_h, stride_delta_h,
                             G, False, HAS_DOC, UPCAST, DOT_PREC, QO_TMA, BLOCK_M, BLOCK_D)

    dk = dk * softmax_scale
    if IS_PAST:
        dk_off = _past_token_offsets(block_table_ptr, j, j_mask, stride_dk_p, stride_dk_t, PAGE_SIZE)
        dv_off = _past_token_offsets(block_table_ptr, j, j_mask, stride_dv_p, stride_dv_t, PAGE_SIZE)
    else:
        dk_off = j.to(tl.int64) * stride_dk_t
        dv_off = j.to(tl.int64) * stride_dv_t
    st_mask = j_mask[:, None] & d_mask[None, :]
    dk_ptrs = dk_ptr + hkv * stride_dk_h + dk_off[:, None] + offs_d[None, :] * stride_dk_d
    dv_ptrs = dv_ptr + hkv * stride_dv_h + dv_off[:, None] + offs_d[None, :] * stride_dv_d
    if IS_PAST:
        # This program owns these gradient-page rows: one read-add-write, no atomics.
        dk += tl.load(dk_ptrs, mask=st_mask, other=0.0)
        dv += tl.load(dv_ptrs, mask=st_mask, other=0.0)
    tl.store(dk_ptrs, dk.to(dk_ptr.dtype.element_ty), mask=st_mask)
    tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=st_mask)

