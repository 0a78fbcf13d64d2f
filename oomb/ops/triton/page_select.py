"""Page selection of sparse attention in one Triton kernel: :func:`select_pages_triton`.

Same contract and the same :class:`~oomb.ops.sparse_select.PageSelection`, bitwise, as
:func:`oomb.ops.sparse_select.select_pages` (tests/ops/test_page_select_triton.py compares the two). The page scores
are the PyTorch ones (the checks and scores of ``select_pages``); everything after them is one launch with no host
synchronisation, where ``select_pages`` runs about twenty small PyTorch ops, two sorts over the past pages among them.

One program per (query block b, KV head h), over the ``n`` scores of its row:

1. Keys. A page is *eligible* when it is at or after the page of the block's earliest document start (every page
   without packed documents), *forced* when eligible and in the sink (the first ``sink_pages`` eligible pages) or
   the local window (the last ``local_pages`` pages), a *candidate* when eligible and not forced. Its key is its
   score upcast to float32 (exact), ``-inf`` for a non-candidate, -0.0 as +0.0, as an order-preserving 32-bit
   unsigned integer (held in int64).
2. The k-th largest key, ``k = min(page_budget, n)``, found four bits at a time from the top: each of 8 passes over
   the row counts the keys at or above 16 thresholds at once; then one pass counts the keys above it.
3. The top ``k`` of the stable descending order are the keys above the k-th and then the lowest-index pages whose
   key equals it (as many as are missing): exactly ``torch.sort(..., descending=True, stable=True)[:k]``. A walk in
   ascending page order keeps the forced pages and the top pages that are candidates (a non-candidate in the top
   takes its slot: select_pages' rule), writing them compacted (a running ``tl.cumsum``), so ``page_idx`` comes
   out ascending; the rest of the row is set to -1 and ``counts`` is written.

Every pass reads the row's scores again (10 reads of ``4 n`` bytes per program, from L2 after the first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sparse_select import PageSelection, _page_scores
from .interpreter import INTERPRET

__all__ = ["select_pages_triton"]

_INT32_MIN = tl.constexpr(-2147483648)
_SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Score dtypes the kernel takes (upcast to float32 exactly); float64 scores stay on the PyTorch path."""


@triton.jit
def _page_keys(row_ptr, stride_n, p, n, first_page, sink_end, local_start):
    """Pages ``p`` [BLOCK_N] of a row -> (ukey int64, in_row, candidate, forced); ukey 0 where ``p >= n``."""
    in_row = p < n
    s = tl.load(row_ptr + p.to(tl.int64) * stride_n, mask=in_row, other=0.0).to(tl.float32)
    eligible = p >= first_page
    forced = eligible & ((p < sink_end) | (p >= local_start))
    cand = eligible & (forced == 0)
    s = tl.where(cand, s, float("-inf"))
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where(bits == _INT32_MIN, 0, bits)  # -0.0 ties with +0.0
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed order of the floats
    ukey = key.to(tl.int64) - _INT32_MIN  # [0, 2**32)
    ukey = tl.where(in_row, ukey, 0)
    return ukey, in_row, cand & in_row, forced & in_row


@triton.jit
def _page_select_kernel(
    scores_ptr,  # [nb, Hkv, n] float32/bf16/fp16 scores, no NaN
    doc_ptr,  # int32/int64 [C] (HAS_DOC only)
    page_idx_ptr,  # int32 [nb, Hkv, K] out
    counts_ptr,  # int32 [nb, Hkv] out
    n, K, C, past_len, Hkv, k_top, sink_pages, local_pages, page_size,
    stride_s_b, stride_s_h, stride_s_n,
    BLOCK_Q: tl.constexpr,  # B, queries per selection block
    BLOCK_QP: tl.constexpr,  # next power of two >= B
    BLOCK_N: tl.constexpr,  # pages per tile
    HAS_DOC: tl.constexpr,
):
    pid = tl.program_id(0)  # b * Hkv + h
    b = pid // Hkv
    h = pid % Hkv
    row_ptr = scores_ptr + b.to(tl.int64) * stride_s_b + h.to(tl.int64) * stride_s_h
    if HAS_DOC:
        i = tl.arange(0, BLOCK_QP)
        qi = b * BLOCK_Q + i
        d = tl.load(doc_ptr + qi, mask=qi < C, other=0).to(tl.int64)
        d = tl.where(qi < C, d, past_len + C)  # rows past the chunk: select_pages' padding
        d = tl.where(i < BLOCK_Q, d, 9223372036854775807)
        dmin = tl.min(d, axis=0)
        first_page = tl.where(dmin >= 0, dmin // page_size, -((page_size - 1 - dmin) // page_size))  # floor
    else:
        first_page = tl.full([], 0, tl.int64)
    sink_end = first_page + sink_pages
    local_start = n - local_pages
    offs = tl.arange(0, BLOCK_N)

    # The k-th largest key t: the largest t with count(ukey >= t) >= k_top, four bits a pass.
    j = tl.arange(0, 16).to(tl.int64)
    t = tl.full([], 0, tl.int64)
    for level in tl.static_range(8):
        shift = 28 - 4 * level
        thr = t + (j << shift)
        cnt = tl.zeros((16,), tl.int32)
        for start in range(0, n, BLOCK_N):
            ukey, in_row, cand, forced = _page_keys(row_ptr, stride_s_n, start + offs, n, first_page, sink_end,
                                                    local_start)
            ge = (ukey[:, None] >= thr[None, :]) & in_row[:, None]
            cnt += tl.sum(ge.to(tl.int32), axis=0)
        digit = tl.sum((cnt >= k_top).to(tl.int64), axis=0) - 1  # cnt[0] >= k_top always
        t += digit << shift
    n_above = tl.full([], 0, tl.int32)
    for start in range(0, n, BLOCK_N):
        ukey, in_row, cand, forced = _page_keys(row_ptr, stride_s_n, start + offs, n, first_page, sink_end,
                                                local_start)
        n_above += tl.sum((in_row & (ukey > t)).to(tl.int32), axis=0)
    take = k_top - n_above  # pages keyed t in the top k, lowest index first (0 when k_top = 0)

    # Ascending walk: keep forced pages and top candidates, compacted.
    out_row = page_idx_ptr + pid.to(tl.int64) * K
    ties = tl.full([], 0, tl.int32)
    base = tl.full([], 0, tl.int32)
    for start in range(0, n, BLOCK_N):
        p = start + offs
        ukey, in_row, cand, forced = _page_keys(row_ptr, stride_s_n, p, n, first_page, sink_end, local_start)
        eq = (in_row & (ukey == t)).to(tl.int32)
        tie_rank = ties + tl.cumsum(eq, axis=0) - eq
        top = in_row & ((ukey > t) | ((eq != 0) & (tie_rank < take)))
        chosen = (forced | (top & cand)).to(tl.int32)
        pos = base + tl.cumsum(chosen, axis=0) - chosen
        tl.store(out_row + pos, p, mask=chosen != 0)
        ties += tl.sum(eq, axis=0)
        base += tl.sum(chosen, axis=0)
    for start in range(0, K, BLOCK_N):
        pos = start + offs
        tl.store(out_row + pos, tl.full((BLOCK_N,), -1, tl.int32), mask=(pos >= base) & (pos < K))
    tl.store(counts_ptr + pid, base)


def select_pages_triton(
    q: torch.Tensor,
    reps: tuple[torch.Tensor, ...],
    past_len: int,
    page_size: int,
    page_budget: int,
    sink_pages: int = 1,
    local_pages: int = 0,
    block_size: int = 128,
    score: str = "mean",
    q_doc_start: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    num_warps: int = 4,
) -> PageSelection:
    """:func:`oomb.ops.sparse_select.select_pages` with the selection after the scores in one kernel.

    Args, returns: as ``select_pages`` (same :class:`PageSelection`, bitwise), plus:
        block_n: pages per tile of the kernel (a power of two); default 1024 on a GPU, 64 in the interpreter.
        num_warps: warps per program.

    Needs ``q``, ``reps`` (and ``q_doc_start``, which is moved there) on a CUDA device, or CPU tensors when Triton
    runs in its interpreter; representatives in float32, bfloat16 or float16 (the scores' dtype: float64 ones go
    to ``select_pages``). ``q_doc_start`` must be int32 or int64 [C]. No host synchronisation.

    Raises:
        ValueError: as ``select_pages``; for float64 representatives, a device the kernel cannot run on, a
            ``q_doc_start`` of another shape or dtype, or a ``block_n`` that is not a power of two.
    """
    device = q.device
    if (device.type == "cuda") == INTERPRET:
        where = "CPU tensors (the interpreter runs)" if INTERPRET else "CUDA tensors"
        raise ValueError(f"select_pages_triton needs {where}; got q on {device}")
    if reps and reps[0].dtype not in _SCORE_DTYPES:
        raise ValueError(f"select_pages_triton takes representatives in {_SCORE_DTYPES}; got {reps[0].dtype} "
                         "(use select_pages)")
    if block_n is None:
        block_n = 64 if INTERPRET else 1024
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    C = q.shape[0]
    if q_doc_start is not None:
        if not isinstance(q_doc_start, torch.Tensor) or q_doc_start.shape != (C,) or q_doc_start.dtype not in (
                torch.int32, torch.int64):
            raise ValueError(f"q_doc_start must be an int32/int64 tensor [C={C}]; got "
                             f"{getattr(q_doc_start, 'dtype', type(q_doc_start))} {tuple(getattr(q_doc_start, 'shape', ()))}")
        q_doc_start = q_doc_start.to(device).contiguous()
    first = _page_scores(q, reps, past_len, page_size, page_budget, sink_pages, local_pages, block_size, score)
    if isinstance(first, PageSelection):
        return first
    scores, n, nb, K, dense = first
    Hkv = scores.shape[1]
    page_idx = torch.empty(nb, Hkv, K, dtype=torch.int32, device=device)
    counts = torch.empty(nb, Hkv, dtype=torch.int32, device=device)
    doc = q_doc_start if q_doc_start is not None else counts  # a dummy the kernel never reads
    _page_select_kernel[(nb * Hkv,)](
        scores, doc, page_idx, counts,
        n, K, C, past_len, Hkv, min(page_budget, n), sink_pages, local_pages, page_size,
        scores.stride(0), scores.stride(1), scores.stride(2),
        BLOCK_Q=block_size, BLOCK_QP=triton.next_power_of_2(block_size), BLOCK_N=block_n,
        HAS_DOC=q_doc_start is not None, num_warps=num_warps,
    )
    return PageSelection(page_idx, counts, block_size, n, dense)
