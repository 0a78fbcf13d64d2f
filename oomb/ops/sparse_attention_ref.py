"""PyTorch reference of sparse attention: one chunk over its SELECTED past pages plus its own K/V (causal).

The contract the Triton kernels (:mod:`oomb.ops.triton.sparse_attention`) are tested against: query block ``b``
(queries ``b*B .. b*B+B-1``) of KV head ``h`` sees the past tokens of pages ``sel.page_idx[b, h]`` (a
:class:`~oomb.ops.sparse_select.PageSelection`) and the own chunk causally; the backward adds dK/dV into the
selected pages only, in place. Computed in the accumulation dtype (float32; float64 for float64 inputs), one
query block at a time.

Shape legend: C own-chunk tokens, Hq query heads, Hkv KV heads, G = Hq // Hkv, D head dim, P pool pages,
S page_size (tokens), B block_size, K selected pages per (block, KV head).
"""

from __future__ import annotations

import math

import torch

from .attention_ref import acc_dtype_for
from .sparse_select import PageSelection

__all__ = ["sparse_attention_bwd_ref", "sparse_attention_fwd_ref"]


def _check(q, k, v, k_cache, block_table, past_len, sel: PageSelection):
    if q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q [C, Hq, D] and k, v [C, Hkv, D] expected; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    C, Hkv = q.shape[0], k.shape[1]
    nb = -(-C // sel.block_size)
    if sel.page_idx.shape[:2] != (nb, Hkv):
        raise ValueError(
            f"selection page_idx {tuple(sel.page_idx.shape)} does not match {nb} query blocks of "
            f"{sel.block_size} and {Hkv} KV heads"
        )
    if past_len > 0 and sel.page_idx.shape[2] > 0:
        if k_cache is None or block_table is None:
            raise ValueError("past_len > 0 needs k_cache, v_cache and block_table")
        need = -(-past_len // k_cache.shape[1])
        if sel.n_past_pages != need or block_table.numel() < need:
            raise ValueError(f"selection made for {sel.n_past_pages} past pages, the past has {need}")


def _groups(x: torch.Tensor, Hkv: int, dtype) -> torch.Tensor:
    """[C, Hq, D] -> [Hkv, G, C, D]."""
    C, Hq, D = x.shape
    return x.to(dtype).view(C, Hkv, Hq // Hkv, D).permute(1, 2, 0, 3)


def _ungroup(x: torch.Tensor) -> torch.Tensor:
    """[Hkv, G, C, D] -> [C, Hq, D]."""
    Hkv, G, C, D = x.shape
    return x.permute(2, 0, 1, 3).reshape(C, Hkv * G, D)


def _own_mask(C: int, past_len: int, doc: torch.Tensor | None, device) -> torch.Tensor:
    """[C, C] True = masked: causal, plus keys before each query's document."""
    i = torch.arange(C, device=device)
    mask = i[None, :] > i[:, None]
    if doc is not None:
        mask |= (past_len + i[None, :]) < doc[:, None]
    return mask


def _block_past(k_cache, v_cache, block_table, pages, past_len, acc):
    """Selected pages of one query block -> k, v [Hkv, K*S, D], token index [Hkv, K*S], valid [Hkv, K*S]."""
    Hkv, K = pages.shape
    S = k_cache.shape[1]
    valid_page = pages >= 0
    logical = pages.clamp(min=0).long()
    phys = block_table.long()[logical]  # [Hkv, K]
    head = torch.arange(Hkv, device=pages.device)[:, None]
    kb = k_cache[phys, :, head, :].to(acc).reshape(Hkv, K * S, -1)  # [Hkv, K, S, D] -> [Hkv, K*S, D]
    vb = v_cache[phys, :, head, :].to(acc).reshape(Hkv, K * S, -1)
    tok = (logical[..., None] * S + torch.arange(S, device=pages.device)).reshape(Hkv, K * S)
    valid = valid_page.repeat_interleave(S, dim=-1) & (tok < past_len)
    rows = (phys[..., None] * S + torch.arange(S, device=pages.device)) * Hkv + head[..., None]  # flat [P*S*Hkv] row
    return kb, vb, tok, valid, rows.reshape(Hkv, K * S)


def _past_mask(tok, valid, doc_b):
    """[Hkv, 1, Bq, K*S] True = masked: padding, beyond past_len, or before the query's document."""
    mask = ~valid[:, None, None, :]
    if doc_b is not None:
        mask = mask | (tok[:, None, None, :] < doc_b[None, None, :, None])
    return mask


def sparse_attention_fwd_ref(
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
    """Attention of one chunk over its SELECTED past pages plus its own K/V (causal).

    Query block ``b`` (queries ``b*B .. b*B+B-1``) of KV head ``h`` sees the past tokens of
    pages ``sel.page_idx[b, h]`` (logical, mapped to pool pages through ``block_table``) and
    the own chunk causally; packed-document masks as in
    :func:`oomb.ops.attention_ref.paged_attention_fwd_ref`.

    Args:
        q: [C, Hq, D]; k, v: [C, Hkv, D]; k_cache, v_cache: [P, S, Hkv, D];
        block_table: int32 [>= n_past_pages]; past_len: tokens; sel: :class:`PageSelection`;
        softmax_scale: default 1/sqrt(D); q_doc_start: optional int [C].

    Returns:
        out [C, Hq, D] in q's dtype; lse [Hq, C] float32 (float64 for float64 q).
    """
    _check(q, k, v, k_cache, block_table, past_len, sel)
    C, Hq, D = q.shape
    Hkv = k.shape[1]
    acc = acc_dtype_for(q.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    doc = None if q_doc_start is None else q_doc_start.to(device=q.device, dtype=torch.int64)
    qg = _groups(q, Hkv, acc)  # [Hkv, G, C, D]
    ko, vo = k.to(acc).permute(1, 0, 2)[:, None], v.to(acc).permute(1, 0, 2)[:, None]  # [Hkv, 1, C, D]
    s = torch.matmul(qg, ko.transpose(-1, -2)) * scale
    s.masked_fill_(_own_mask(C, past_len, doc, q.device), -torch.inf)
    lse = torch.logsumexp(s, -1)  # [Hkv, G, C]
    out = torch.matmul(torch.exp(s - lse[..., None]), vo)
    del s
    B = sel.block_size
    if past_len > 0 and sel.page_idx.shape[2] > 0:
        for b in range(-(-C // B)):
            r0, r1 = b * B, min(C, b * B + B)
            kb, vb, tok, valid, _ = _block_past(k_cache, v_cache, block_table, sel.page_idx[b], past_len, acc)
            s = torch.matmul(qg[:, :, r0:r1], kb[:, None].transpose(-1, -2)) * scale  # [Hkv, G, Bq, K*S]
            s.masked_fill_(_past_mask(tok, valid, None if doc is None else doc[r0:r1]), -torch.inf)
            lse_b = torch.logsumexp(s, -1)
            out_b = torch.matmul(torch.exp(s - torch.where(torch.isinf(lse_b), 0.0, lse_b)[..., None]), vb[:, None])
            old = lse[:, :, r0:r1]
            new = torch.logaddexp(old, lse_b)
            out[:, :, r0:r1] = out[:, :, r0:r1] * torch.exp(old - new)[..., None] + out_b * torch.exp(lse_b - new)[..., None]
            lse[:, :, r0:r1] = new
    return _ungroup(out).to(q.dtype), lse.reshape(Hq, C)


def sparse_attention_bwd_ref(
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
    """Backward of :func:`sparse_attention_fwd_ref`.

    The selected past pages' dK/dV are ADDED into ``dk_cache``/``dv_cache`` ([P, S, Hkv, D],
    contiguous, float32/float64) in place; no other page is touched.

    Returns:
        dq [C, Hq, D] in q's dtype; dk, dv [C, Hkv, D] in k's dtype (own chunk's contribution only).
    """
    _check(q, k, v, k_cache, block_table, past_len, sel)
    has_past = past_len > 0 and sel.page_idx.shape[2] > 0
    if has_past and (dk_cache is None or dv_cache is None or not dk_cache.is_contiguous() or not dv_cache.is_contiguous()):
        raise ValueError("a selection with past pages needs contiguous dk_cache/dv_cache [P, S, Hkv, D]")
    C, Hq, D = q.shape
    Hkv = k.shape[1]
    acc = acc_dtype_for(q.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    doc = None if q_doc_start is None else q_doc_start.to(device=q.device, dtype=torch.int64)
    qg, dog = _groups(q, Hkv, acc), _groups(dout, Hkv, acc)
    delta = (dog * _groups(out, Hkv, acc)).sum(-1)  # [Hkv, G, C]
    lse_g = lse.to(acc).reshape(Hkv, -1, C)

    def grads(qs, dos, lse_s, delta_s, kb, vb, mask):
        s = torch.matmul(qs, kb.transpose(-1, -2)) * scale
        s.masked_fill_(mask, -torch.inf)
        p = torch.exp(s - lse_s[..., None])
        del s
        dvb = torch.matmul(p.transpose(-1, -2), dos).sum(1)  # [Hkv, N, D], summed over the group
        ds = p * (torch.matmul(dos, vb.transpose(-1, -2)) - delta_s[..., None])
        del p
        dqb = torch.matmul(ds, kb) * scale
        dkb = torch.matmul(ds.transpose(-1, -2), qs).sum(1) * scale
        return dqb, dkb, dvb

    ko, vo = k.to(acc).permute(1, 0, 2)[:, None], v.to(acc).permute(1, 0, 2)[:, None]
    dq, dk_own, dv_own = grads(qg, dog, lse_g, delta, ko, vo, _own_mask(C, past_len, doc, q.device))
    B = sel.block_size
    if has_past:
        dk_rows, dv_rows = dk_cache.view(-1, D), dv_cache.view(-1, D)
        for b in range(-(-C // B)):
            r0, r1 = b * B, min(C, b * B + B)
            kb, vb, tok, valid, rows = _block_past(k_cache, v_cache, block_table, sel.page_idx[b], past_len, acc)
            mask = _past_mask(tok, valid, None if doc is None else doc[r0:r1])
            dqb, dkb, dvb = grads(
                qg[:, :, r0:r1], dog[:, :, r0:r1], lse_g[:, :, r0:r1], delta[:, :, r0:r1], kb[:, None], vb[:, None], mask
            )
            dq[:, :, r0:r1] += dqb
            rows = rows[valid]  # padding and tokens past past_len get nothing
            dk_rows.index_add_(0, rows, dkb[valid].to(dk_rows.dtype))
            dv_rows.index_add_(0, rows, dvb[valid].to(dv_rows.dtype))
    return (
        _ungroup(dq).to(q.dtype),
        dk_own.permute(1, 0, 2).to(k.dtype),
        dv_own.permute(1, 0, 2).to(v.dtype),
    )

