"""Triton sparse paged attention launchers: each query block reads only its selected past pages.

Same contract as :func:`oomb.ops.sparse_attention_ref.sparse_attention_fwd_ref` /
:func:`oomb.ops.sparse_attention_ref.sparse_attention_bwd_ref` (the reference every test compares against):
query block ``b`` (queries ``b*B .. b*B+B-1``) of KV head ``h`` attends to the past pages
``page_idx[b, h, :counts[b, h]]`` (logical, ascending; mapped to pool pages through
``block_table``) plus the whole own chunk, causally.

How the work is split (shape legend as in :mod:`oomb.ops.triton.paged_attention`; B queries per
selection block, K selected pages per (block, KV head), n past pages):

* Forward and dq: one program per (row tile of ONE query block, KV head), over the block's selected past pages
  and then the chunk's own keys (causal, the dense kernels' own-chunk loop, :func:`.tiles._own_fwd` /
  :func:`.tiles._own_dq`), in one online softmax: the output, its log-sum-exp and dq are written once, in their
  final dtype (no merge of partial results, no second launch). Rows are the dense kernels' query-major (query,
  head-in-group) pairs, so a tile holds all G heads of its queries and shares each K/V tile among them; a tile
  never straddles two query blocks. The last query block is launched first (it has the most own keys). The
  block's selected pages are walked as one virtual token sequence ``u = slot * S + t`` (page
  ``page_idx[b, h, slot]``, slot token ``t``) in ``BLOCK_N`` tiles, so a tile may span several selected pages or
  part of one, whatever ``page_size``. A chunk with no past pages (or none selected) runs the dense kernels
  (:func:`~oomb.ops.triton.paged_attention.paged_attention_fwd` / ``paged_attention_bwd`` with ``past_len=0``).
* dK/dV of the own keys: the dense kernel (``paged_attention_bwd`` with ``past_len=0``, no dq), with the
  same ``delta = rowsum(dout * out)`` as the sparse kernels, computed once.
* dK/dV (past): one program per (past page, token tile of it, KV head), which loops over the
  query blocks that selected the page -- an inverse (CSR) map the launcher builds from
  ``page_idx`` -- and over their row tiles, in ascending order, then does ONE read-add-write
  of its gradient-page rows. Its rows are walked head-major, as the dense dk/dv kernel's: a row
  tile is ``BLOCK_M`` consecutive queries of one head of the group (a plain 2-D tile of q/dout,
  or one tensor-descriptor box), not the forward's interleaved (query, head) rows. Pages no
  block selected are not touched. As in the dense kernels, no atomics: the result is bitwise reproducible. Programs are launched most-selected page
  first (longest-processing-time order): the sink and local pages, which every block selects,
  would otherwise be among the last launched and finish alone.

Every row sees at least its own key (the diagonal), so every output row and log-sum-exp is finite.

Tensor descriptors (TMA, Hopper or newer; :mod:`.tma`): the forward and dq kernels read the K/V tiles of full
selected pages through descriptors of the pool seen as [P * S, Hkv * D] (a partial last page of the past, and
packed documents, keep the masked gather), and the dK/dV kernel its q/dout row tiles through [Hq, C, D]
descriptors; results equal the gathered tiles' to rounding (the same products and sums; compiled, the two
loops may round differently).

Settings: the ``kernels`` argument (a :class:`oomb.config.KernelConfig`); these kernels read its ``autotune``,
``fwd_tma`` (forward), ``bwd_tma`` (dq) and ``dkdv_tma`` (dK/dV), and the own-chunk calls of the dense kernels
read theirs as well (they run the own chunk's dK/dV, and chunks without past pages).
"""

from __future__ import annotations

import torch
import triton

from ...config.engine import KernelConfig
from ..sparse_select import PageSelection
from .inputs import LOG2E, _alloc, _check_doc, _check_inputs, _delta, _dot_precision, _drain_streams_before_first_tune
from .interpreter import INTERPRET
from .paged_attention import paged_attention_bwd, paged_attention_fwd
from .sparse_kernels import _sparse_attn_bwd_dkdv_kernel, _sparse_attn_bwd_dq_kernel, _sparse_attn_fwd_kernel
from .tma import qo_tma, use_tma

__all__ = ["sparse_attention_bwd", "sparse_attention_fwd"]


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
                BLOCK_D=max(16, triton.next_power_of_2(D)), UPCAST=INTERPRET, DOT_PREC=_dot_precision(q.dtype),
                HAS_DOC=doc is not None)


def _has_past(sel: PageSelection, past_len: int) -> bool:
    return past_len > 0 and sel.page_idx.shape[2] > 0


def _tma_args(kernel, k_cache: torch.Tensor, v_cache: torch.Tensor, D: int, page_size: int, doc, enabled: bool) -> dict:
    """USE_TMA and the pool's [rows, cols] view for a forward / dq launch: full-page tiles go through tensor
    descriptors where :func:`~oomb.ops.triton.tma.use_tma` allows it and there are no packed documents (whose tiles
    are masked)."""
    tma = doc is None and use_tma(k_cache, v_cache, D, page_size, kernel.configs, enabled)
    P, S, Hkv, _ = k_cache.shape
    return dict(USE_TMA=tma, n_rows=P * S if tma else 0, n_cols=Hkv * D if tma else 0)


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
    *,
    kernels: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one chunk over its selected past pages plus its own K/V (causal).

    Args:
        q: [C, Hq, D]; k, v: [C, Hkv, D] (bf16/fp16/fp32, any strides).
        k_cache, v_cache: [P, S, Hkv, D] in q's dtype; block_table: int32 [>= n] logical -> pool page.
        past_len: past tokens; sel: :class:`~oomb.ops.sparse_select.PageSelection` (int32, on q's device)
            made for ceil(past_len / S) past pages; softmax_scale: default 1/sqrt(D);
        q_doc_start: optional int [C] (packed documents, as in the dense kernels).
        kernels: kernel settings (``autotune``, and the dense kernels' for the own chunk). None: ``KernelConfig()``.

    Returns:
        out [C, Hq, D] in q's dtype (contiguous); lse [Hq, C] float32.

    Raises:
        ValueError: as :func:`~oomb.ops.triton.paged_attention.paged_attention_fwd`, plus a
            selection of the wrong shape, dtype or device.
    """
    kernels = KernelConfig() if kernels is None else kernels
    fwd_kernel = _sparse_attn_fwd_kernel[kernels.autotune]
    C, Hq, Hkv, D, page_size, scale = _check_inputs(q, k, v, k_cache, v_cache, block_table, past_len, softmax_scale)
    page_idx, counts = _check_selection(sel, C, Hkv, past_len, page_size, q.device)
    doc = _check_doc(q_doc_start, C, past_len, q.device)
    if not _has_past(sel, past_len) or C == 0:
        return paged_attention_fwd(q, k, v, None, None, None, 0, scale, q_doc_start=_shift(doc, past_len), kernels=kernels)
    out = _alloc((C, Hq, D), q.dtype, q.device)
    lse = _alloc((Hq, C), torch.float32, q.device)
    nb = page_idx.shape[0]
    bt = block_table.contiguous()

    def grid(meta):
        return (nb * triton.cdiv(sel.block_size * (Hq // Hkv), meta["BLOCK_M"]), Hkv)

    skc, svc = k_cache.stride(), v_cache.stride()
    fwd_kernel[grid](
        q_ptr=q, k_ptr=k, v_ptr=v, k_cache_ptr=k_cache, v_cache_ptr=v_cache, block_table_ptr=bt, sel_ptr=page_idx,
        counts_ptr=counts, out_ptr=out, lse_ptr=lse, doc_ptr=doc if doc is not None else bt,
        C=C, past_len=past_len, qk_scale=scale * LOG2E,
        stride_q_c=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        stride_k_c=k.stride(0), stride_k_h=k.stride(1), stride_k_d=k.stride(2),
        stride_v_c=v.stride(0), stride_v_h=v.stride(1), stride_v_d=v.stride(2),
        stride_kc_p=skc[0], stride_kc_t=skc[1], stride_kc_h=skc[2], stride_kc_d=skc[3],
        stride_vc_p=svc[0], stride_vc_t=svc[1], stride_vc_h=svc[2], stride_vc_d=svc[3],
        stride_sel_b=page_idx.stride(0), stride_sel_h=page_idx.stride(1),
        stride_cnt_b=counts.stride(0), stride_cnt_h=counts.stride(1),
        stride_o_c=out.stride(0), stride_o_h=out.stride(1), stride_o_d=out.stride(2),
        stride_lse_h=lse.stride(0),
        **_common(q, sel, D, page_size, doc), **_tma_args(fwd_kernel, k_cache, v_cache, D, page_size, doc, kernels.fwd_tma),
    )
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
    *,
    kernels: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`sparse_attention_fwd`; adds the selected past pages' dK/dV in place.

    Args:
        as :func:`~oomb.ops.triton.paged_attention.paged_attention_bwd`, plus ``sel``.
        dk_cache, dv_cache: float32 [P, S, Hkv, D]; only rows of selected pages (below past_len)
            change, deterministically (no atomics).
        kernels: as :func:`sparse_attention_fwd`.

    Returns:
        dq [C, Hq, D] in q's dtype; dk, dv [C, Hkv, D] in k's dtype (own chunk's contribution only).
    """
    kernels = KernelConfig() if kernels is None else kernels
    dq_kernel = _sparse_attn_bwd_dq_kernel[kernels.autotune]
    dkdv_kernel = _sparse_attn_bwd_dkdv_kernel[kernels.autotune]
    C, Hq, Hkv, D, page_size, scale = _check_inputs(q, k, v, k_cache, v_cache, block_table, past_len, softmax_scale)
    page_idx, counts = _check_selection(sel, C, Hkv, past_len, page_size, q.device)
    doc = _check_doc(q_doc_start, C, past_len, q.device)
    has_past = _has_past(sel, past_len) and C > 0
    if has_past:
        for name, t in (("dk_cache", dk_cache), ("dv_cache", dv_cache)):
            if t is None or t.shape != k_cache.shape or t.dtype != torch.float32 or t.device != q.device:
                raise ValueError(f"a selection with past pages needs {name} float32 {tuple(k_cache.shape)} on {q.device}")
    if not has_past:
        return paged_attention_bwd(dout, q, k, v, out, lse, None, None, None, 0, None, None, scale,
                                   q_doc_start=_shift(doc, past_len), kernels=kernels)
    delta = _delta(dout, out)
    # The own keys' dK/dV: the dense kernel with no past (it uses the full lse and delta, so this is exact); their
    # dq is the sparse dq kernel's own-chunk loop.
    _, dk, dv = paged_attention_bwd(dout, q, k, v, out, lse, None, None, None, 0, None, None, scale,
                                    q_doc_start=_shift(doc, past_len), delta=delta, with_dq=False, kernels=kernels)
    bt = block_table.contiguous()
    doc_arg = doc if doc is not None else bt
    common = _common(q, sel, D, page_size, doc)
    nb = page_idx.shape[0]
    skc, svc = k_cache.stride(), v_cache.stride()
    dq = _alloc((C, Hq, D), q.dtype, q.device)

    def grid_rows(meta):
        return (nb * triton.cdiv(sel.block_size * (Hq // Hkv), meta["BLOCK_M"]), Hkv)

    dq_kernel[grid_rows](
        q_ptr=q, k_ptr=k, v_ptr=v, k_cache_ptr=k_cache, v_cache_ptr=v_cache, block_table_ptr=bt, sel_ptr=page_idx,
        counts_ptr=counts, dout_ptr=dout, lse_ptr=lse, delta_ptr=delta, dq_ptr=dq, doc_ptr=doc_arg,
        C=C, past_len=past_len, qk_scale=scale * LOG2E, softmax_scale=scale,
        stride_q_c=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        stride_k_c=k.stride(0), stride_k_h=k.stride(1), stride_k_d=k.stride(2),
        stride_v_c=v.stride(0), stride_v_h=v.stride(1), stride_v_d=v.stride(2),
        stride_kc_p=skc[0], stride_kc_t=skc[1], stride_kc_h=skc[2], stride_kc_d=skc[3],
        stride_vc_p=svc[0], stride_vc_t=svc[1], stride_vc_h=svc[2], stride_vc_d=svc[3],
        stride_sel_b=page_idx.stride(0), stride_sel_h=page_idx.stride(1),
        stride_cnt_b=counts.stride(0), stride_cnt_h=counts.stride(1),
        stride_do_c=dout.stride(0), stride_do_h=dout.stride(1), stride_do_d=dout.stride(2),
        stride_dq_c=dq.stride(0), stride_dq_h=dq.stride(1), stride_dq_d=dq.stride(2),
        stride_lse_h=lse.stride(0), stride_delta_h=delta.stride(0),
        **common, **_tma_args(dq_kernel, k_cache, v_cache, D, page_size, doc, kernels.bwd_tma),
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
    q_tma = qo_tma(q, dout, D, kernels.dkdv_tma)
    _drain_streams_before_first_tune("sparse_dkdv", q, dict(common, QO_TMA=q_tma, autotune=kernels.autotune))
    dkdv_kernel[grid_pages](
        q_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache, block_table_ptr=bt, csr_offsets_ptr=offsets,
        csr_blocks_ptr=blocks, work_order_ptr=work_order, dout_ptr=dout, lse_ptr=lse, delta_ptr=delta,
        dk_cache_ptr=dk_cache, dv_cache_ptr=dv_cache, doc_ptr=doc_arg,
        C=C, past_len=past_len, n_pages=n_pages, qk_scale=scale * LOG2E, softmax_scale=scale, Hq=Hq,
        stride_q_c=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        stride_kc_p=skc[0], stride_kc_t=skc[1], stride_kc_h=skc[2], stride_kc_d=skc[3],
        stride_vc_p=svc[0], stride_vc_t=svc[1], stride_vc_h=svc[2], stride_vc_d=svc[3],
        stride_do_c=dout.stride(0), stride_do_h=dout.stride(1), stride_do_d=dout.stride(2),
        stride_dk_p=sdk[0], stride_dk_t=sdk[1], stride_dk_h=sdk[2], stride_dk_d=sdk[3],
        stride_dv_p=sdv[0], stride_dv_t=sdv[1], stride_dv_h=sdv[2], stride_dv_d=sdv[3],
        stride_lse_h=lse.stride(0), stride_delta_h=delta.stride(0),
        **common, QO_TMA=q_tma,
    )
    return dq, dk, dv
