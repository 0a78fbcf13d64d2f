"""Page-level top-K sparse attention (DESIGN.md §2.4): page representatives, selection, reference.

For long pasts each block of ``block_size`` queries (default 128) of a chunk attends, per KV
head, only to a few past pages plus its own chunk (causal). Three pieces:

1. **Representatives.** When a chunk's post-RoPE keys are written (Stage 1) each page gets a
   small summary per KV head: the mean of its keys (MoBA; OOMB's published choice) or the
   element-wise min and max (Quest, Tang et al. 2024, "Quest: Query-Aware Sparsity for
   Efficient Long-Context LLM Inference", §3.2). A partial page is summarised over its valid
   tokens only. Kept on the device in the accumulation dtype (float32; float64 for float64
   models): ``[num_layers, max_pages, Hkv, D]`` (twice that for Quest), indexed by LOGICAL page
   (token ``t`` is in page ``t // page_size``), so it does not depend on which pool page holds
   the tokens or on where the store keeps them.
2. **Selection** (:func:`select_pages`), per (query block, KV head): let ``q_sum`` be the sum
   of the block's queries over its rows and the G query heads of the group. Page score:

   * ``'mean'``:  ``q_sum · mean_k`` (softmax-free: a monotone stand-in for the attention mass
     of the group on the page);
   * ``'quest'``: ``sum_d max(q_sum_d * min_d, q_sum_d * max_d)``, an upper bound on
     ``q_sum · k`` over the page's keys (Quest's bound, applied to the summed query).

   Always kept: the first ``sink_pages`` pages (attention sink; Xiao et al. 2023, StreamingLLM)
   and the last ``local_pages`` past pages (local window), then the ``page_budget`` best-scoring
   of the others. Ties go to the lower page index; only past pages can be chosen. With packed
   documents, pages wholly before the earliest document of the block are never chosen (they are
   masked anyway), and the sink is the first pages of that document. When every past page fits (``n_past_pages <= page_budget + sink_pages +
   local_pages``) every page is selected and attention is exactly dense.
   The result is a :class:`PageSelection`: int32 ``page_idx [n_qblocks, Hkv, K_max]`` of
   logical past pages, ascending, padded with -1, and ``counts [n_qblocks, Hkv]``. It is made
   once in Stage 1 and reused unchanged by the Stage-2 recompute and backward; no gradient
   flows through it.
3. **Attention** over the selection: :func:`sparse_attention_fwd_ref` /
   :func:`sparse_attention_bwd_ref` (PyTorch reference; the backward adds dK/dV into the
   selected pages only, in place), the Triton kernels of
   :mod:`oomb.ops.triton_sparse_attention` (same contract), and :func:`sparse_paged_attention`
   (autograd over either, same contract as :func:`oomb.ops.paged_attention.paged_attention`;
   a dense selection takes the dense path unchanged).

Memory kept per step on the device: summaries ``L * ceil(T / S) * Hkv * D * 4`` bytes (twice
for Quest; Qwen2.5-7B at 1M tokens: 0.44 GiB) and, between Stage 1 and Stage 2, the selections,
``L * (N - 1) * ceil(C / B) * Hkv * K * 4`` bytes (same model, chunk 4096, K = 73: 0.25 GiB).

Shape legend: C own-chunk tokens, Hq query heads, Hkv KV heads, G = Hq // Hkv, D head dim,
P pool pages, S page_size (tokens), B block_size (queries per selection block),
nb = ceil(C / B) query blocks, K = K_max selected pages per (block, KV head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention_ref import acc_dtype_for
from .paged_attention import PagedKV, paged_attention, paged_attention_forward

__all__ = [
    "SCORES",
    "PageSelection",
    "PageRepresentatives",
    "SparseAttentionState",
    "page_representatives",
    "select_pages",
    "selection_mask",
    "sparse_attention_fwd_ref",
    "sparse_attention_bwd_ref",
    "sparse_paged_attention",
    "sparse_paged_attention_forward",
]

SCORES = ("mean", "quest")


# ----------------------------------------------------------------------------- representatives
def page_representatives(k: torch.Tensor, page_size: int, score: str = "mean") -> tuple[torch.Tensor, ...]:
    """Per-page summaries of consecutive keys.

    Args:
        k: [n, Hkv, D] post-RoPE keys starting at a page boundary (the last page may be partial).
        page_size: S, tokens per page.
        score: 'mean' or 'quest'.

    Returns:
        'mean': ``(mean,)``; 'quest': ``(kmin, kmax)``; each [ceil(n / S), Hkv, D] in the
        accumulation dtype (float32, float64 for float64 keys), over the valid tokens of each page.
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    n, Hkv, D = k.shape
    S = page_size
    n_pages = -(-n // S)
    acc = acc_dtype_for(k.dtype)
    if n_pages == 0:
        return tuple(torch.zeros(0, Hkv, D, dtype=acc, device=k.device) for _ in range(1 if score == "mean" else 2))
    kp = torch.zeros(n_pages * S, Hkv, D, dtype=acc, device=k.device)
    kp[:n] = k.to(acc)
    kp = kp.view(n_pages, S, Hkv, D)
    if score == "mean":
        counts = torch.full((n_pages,), S, dtype=acc, device=k.device)
        counts[-1] = n - (n_pages - 1) * S
        return (kp.sum(1) / counts[:, None, None],)
    valid = (torch.arange(n_pages * S, device=k.device) < n).view(n_pages, S, 1, 1)
    kmin = torch.where(valid, kp, torch.inf).amin(1)
    kmax = torch.where(valid, kp, -torch.inf).amax(1)
    return kmin, kmax


class PageRepresentatives:
    """Page summaries of every layer of one sequence, on the device, by logical page.

    Args:
        num_layers, num_kv_heads, head_dim: model shape.
        max_pages: pages per layer (ceil(T / page_size)).
        page_size: S in tokens.
        score: 'mean' (one [L, max_pages, Hkv, D] tensor) or 'quest' (min and max: two).
        dtype: accumulation dtype (float32; float64 for float64 models).
        device: where they live (the GPU in training).
    """

    def __init__(self, num_layers, num_kv_heads, head_dim, max_pages, page_size, score, dtype, device) -> None:
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        self.page_size, self.score, self.max_pages = page_size, score, max_pages
        shape = (num_layers, max_pages, num_kv_heads, head_dim)
        self.tensors = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(1 if score == "mean" else 2))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def write(self, layer: int, start: int, k: torch.Tensor) -> None:
        """Summarise keys ``k [n, Hkv, D]`` of tokens [start, start + n) of ``layer`` (start page-aligned)."""
        if start % self.page_size:
            raise ValueError(f"representatives: start {start} is not page-aligned (page_size {self.page_size})")
        p0 = start // self.page_size
        for dst, src in zip(self.tensors, page_representatives(k, self.page_size, self.score)):
            dst[layer, p0 : p0 + src.shape[0]] = src.to(dst.dtype)

    def layer(self, layer: int, n_pages: int) -> tuple[torch.Tensor, ...]:
        """Summaries of the first ``n_pages`` pages of ``layer``: views [n_pages, Hkv, D]."""
        return tuple(t[layer, :n_pages] for t in self.tensors)


# ----------------------------------------------------------------------------------- selection
@dataclass
class PageSelection:
    """The past pages each (query block, KV head) of one (chunk, layer) attends to.

    Attributes:
        page_idx: int32 [nb, Hkv, K] logical past-page indices, ascending, padded with -1.
        counts: int32 [nb, Hkv] valid entries per row of ``page_idx``.
        block_size: B, queries per block (the last block of a chunk may be shorter).
        n_past_pages: ceil(past_len / page_size) when the selection was made.
        dense: every past page is selected for every block (attention is exactly dense).
    """

    page_idx: torch.Tensor
    counts: torch.Tensor
    block_size: int
    n_past_pages: int
    dense: bool


def _page_scores(q, reps, past_len, page_size, page_budget, sink_pages, local_pages, block_size, score):
    """The checks and block scores shared by :func:`select_pages` and :func:`_select_pages_topk` (same arguments).

    Returns:
        the empty :class:`PageSelection` when there is no past, else ``(scores, n, nb, K, dense)``: float
        ``scores`` [nb, Hkv, n] in the representatives' dtype (NaN as -inf), n past pages, nb query blocks,
        K = min(n, page_budget + sink_pages + local_pages), and whether that keeps every page.

    Raises:
        ValueError: as :func:`select_pages`.
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    for name, val in (("page_budget", page_budget), ("sink_pages", sink_pages), ("local_pages", local_pages)):
        if val < 0:
            raise ValueError(f"{name} must be >= 0 pages, got {val}")
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive number of queries, got {block_size}")
    C, Hq, D = q.shape
    Hkv = reps[0].shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    S, B = page_size, block_size
    n = -(-past_len // S)
    nb = -(-C // B)
    K = min(n, page_budget + sink_pages + local_pages)
    dense = n <= page_budget + sink_pages + local_pages
    device = q.device
    if n == 0:
        empty = torch.empty(nb, Hkv, 0, dtype=torch.int32, device=device)
        return PageSelection(empty, torch.zeros(nb, Hkv, dtype=torch.int32, device=device), B, 0, True)
    if reps[0].shape[0] < n:
        raise ValueError(f"representatives cover {reps[0].shape[0]} pages, the past has {n}")

    acc = reps[0].dtype
    G = Hq // Hkv
    qp = torch.zeros(nb * B, Hkv, G, D, dtype=acc, device=device)
    qp[:C] = q.detach().to(acc).view(C, Hkv, G, D)
    q_sum = qp.view(nb, B, Hkv, G, D).sum((1, 3))  # [nb, Hkv, D]
    if score == "mean":
        scores = torch.einsum("bhd,nhd->bhn", q_sum, reps[0][:n])
    else:
        kmin, kmax = reps[0][:n], reps[1][:n]
        # max(q*lo, q*hi) = relu(q)*hi + min(q, 0)*lo, summed over d: two matrix products.
        scores = torch.einsum("bhd,nhd->bhn", q_sum.clamp(min=0), kmax) + torch.einsum(
            "bhd,nhd->bhn", q_sum.clamp(max=0), kmin
        )
    # NaN -> -inf: never wins (ties with the non-candidates, ranked by index). nan_to_num's defaults
    # also map +-inf to the largest/lowest finite value, so a -inf score still beats a NaN one.
    scores = torch.nan_to_num(scores, nan=-torch.inf)
    return scores, n, nb, K, dense


def _select_pages_topk(
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
) -> PageSelection:
    """:func:`select_pages` without sorting over the ``n`` past pages (an independent implementation of the same
    selection, bitwise equal: the tests and ``benchmarks/bench_select.py`` compare the two). Args, returns and
    errors: as :func:`select_pages`.

    Cost, per (block, KV head) over the n past pages: O(n) elementwise work and one ``topk`` of
    ``page_budget`` (see :func:`_stable_top`), then a sort of at most
    ``page_budget + sink_pages + local_pages`` entries; no sort over n. Bitwise equal to the
    two-sort :func:`select_pages` (tests/test_sparse_select_property.py).
    """
    first = _page_scores(q, reps, past_len, page_size, page_budget, sink_pages, local_pages, block_size, score)
    if isinstance(first, PageSelection):
        return first
    scores, n, nb, K, dense = first
    C, Hkv, S, B, device = q.shape[0], reps[0].shape[1], page_size, block_size, q.device

    # Pages are split by position only: eligible = page >= first_page (the block's earliest document;
    # 0 without packing); forced = the sink [first_page, sink_end) and the local window
    # [local_start, n), where eligible; candidates = the eligible rest, [sink_end, local_start).
    if q_doc_start is None:
        first_page = torch.zeros(nb, 1, 1, dtype=torch.int64, device=device)
    else:
        dp = torch.full((nb * B,), past_len + C, dtype=torch.int64, device=device)
        dp[:C] = q_doc_start.to(device=device, dtype=torch.int64)
        first_page = (dp.view(nb, B).amin(1) // S)[:, None, None]  # [nb, 1, 1] page of the block's earliest document start
    sink_end = first_page + sink_pages  # [nb, 1, 1]
    local_start = n - local_pages
    page = torch.arange(n, device=device)
    candidate = (page >= sink_end) & (page < local_start)  # [nb, 1, n]
    cand_scores = torch.where(candidate, scores, -torch.inf)
    # The budget is the first page_budget pages of the stable descending order of ALL pages, then
    # filtered to candidates: a non-candidate (-inf) at a lower index takes the place of a candidate
    # scored -inf (a NaN score), exactly as in the two-sort reference.
    top = _stable_top(cand_scores, min(page_budget, n))  # [nb, Hkv, min(page_budget, n)], any order
    top = torch.where((top >= sink_end) & (top < local_start), top, n)
    # Forced pages, each listed once: sink pages inside the past; local pages that are eligible and
    # not in the sink (both mean page >= sink_end, as sink_end >= first_page).
    sink = first_page + torch.arange(sink_pages, device=device)  # [nb, 1, sink_pages]
    sink = torch.where((sink >= 0) & (sink < n), sink, n)
    local = local_start + torch.arange(local_pages, device=device)  # [nb, 1, local_pages] (all < n)
    local = torch.where((local >= 0) & (local >= sink_end), local, n)
    # The three lists are disjoint, so the chosen pages are their valid entries without duplicates; at
    # most min(n, page_budget + sink_pages + local_pages) = K of them. Sort only these (n = none).
    listed = torch.cat([top, sink.expand(nb, Hkv, -1), local.expand(nb, Hkv, -1)], dim=-1)
    counts = (listed < n).sum(-1).to(torch.int32)
    page_idx = torch.sort(listed, dim=-1).values[..., :K]
    page_idx = torch.where(page_idx == n, -1, page_idx).to(torch.int32)
    return PageSelection(page_idx, counts, B, n, dense)


def _stable_top(x: torch.Tensor, k: int) -> torch.Tensor:
    """The first ``k`` indices of ``torch.sort(x, -1, descending=True, stable=True)``, as a set.

    That order is "higher value first, equal values by ascending index" (and -0.0 equals +0.0). It is
    a total order, so its first k entries are the k largest of a unique key that encodes it; one
    ``topk`` finds them in O(n) instead of an O(n log n) sort.

    Args:
        x: float [..., n] without NaN (float32 or narrower, or float64), n < 2**32.
        k: 0 <= k <= n.

    Returns:
        int64 [..., k] indices in no particular order.

    Keys (``rev = n - 1 - index``, so the lower index has the larger key):

    * float32 (and narrower, upcast exactly): ``(ordered << 32) | rev``, where ``ordered`` is the
      float's bits made order-preserving as an int32 (negative floats: flip all bits but the sign)
      after ``x + 0.0`` turns -0.0 into +0.0. Unique, and ordered exactly as the stable sort.
    * float64 (no room for the index): ``t``, the k-th largest value, comes from a ``topk`` of the
      values (a multiset, so deterministic). The first k of the stable order are every value > t
      (fewer than k) and then the lowest-index values == t; a second ``topk`` on
      ``((x > t) + (x >= t)) << 32 | rev`` takes exactly those.
    """
    n = x.shape[-1]
    if k == 0:
        return torch.empty(*x.shape[:-1], 0, dtype=torch.int64, device=x.device)
    rev = torch.arange(n - 1, -1, -1, device=x.device)
    if x.dtype == torch.float64:
        t = torch.topk(x, k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
        rank = (x > t).to(torch.int64) + (x >= t).to(torch.int64)  # 2 above, 1 at, 0 below the k-th value
    else:
        bits = (x.to(torch.float32) + 0.0).view(torch.int32)
        rank = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    return torch.topk((rank << 32) | rev, k, dim=-1, sorted=False).indices


def select_pages(
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
) -> PageSelection:
    """Top-K past pages per (block of ``block_size`` queries, KV head); see the module docstring.

    Two stable sorts over the ``n`` past pages: descending over the candidates' scores for the top
    ``page_budget`` (equal scores: the lower page first), ascending to list the chosen pages.
    :func:`_select_pages_topk` computes the same :class:`PageSelection` bitwise without sorting over n
    (tests/test_sparse_select_property.py); it is faster on the CPU but was slower on an H200 for up to
    8,192 past pages (0.95 against 0.67 ms at 8,192; ``benchmarks/results/select_h200_2026-12-01_eleventh.json``),
    so this is the one the engine uses.

    Args:
        q: [C, Hq, D] post-RoPE queries of the chunk (Hq a multiple of Hkv).
        reps: summaries of the first ceil(past_len / S) (or more) logical pages, each [>= n, Hkv, D]:
            ``(mean,)`` for 'mean', ``(kmin, kmax)`` for 'quest'.
        past_len: past tokens (a partial last page is a page).
        page_size: S in tokens.
        page_budget, sink_pages, local_pages: pages (>= 0).
        block_size: queries per selection block.
        score: 'mean' or 'quest'.
        q_doc_start: optional int [C] absolute first token of each query's document (packed data).

    Returns:
        :class:`PageSelection` with K = min(n_past_pages, page_budget + sink_pages + local_pages).
    """
    first = _page_scores(q, reps, past_len, page_size, page_budget, sink_pages, local_pages, block_size, score)
    if isinstance(first, PageSelection):
        return first
    scores, n, nb, K, dense = first
    C, Hkv, S, B, device = q.shape[0], reps[0].shape[1], page_size, block_size, q.device

    page = torch.arange(n, device=device)
    eligible = torch.ones(nb, 1, n, dtype=torch.bool, device=device)
    sink = (page < sink_pages)[None, None, :]
    if q_doc_start is not None:
        dp = torch.full((nb * B,), past_len + C, dtype=torch.int64, device=device)
        dp[:C] = q_doc_start.to(device=device, dtype=torch.int64)
        first_page = (dp.view(nb, B).amin(1) // S)[:, None, None]  # [nb, 1, 1] page of the block's earliest document start
        eligible = page >= first_page  # the page has a token of the block's documents
        sink = eligible & (page < first_page + sink_pages)  # the sink is that document's first pages
    forced = (sink | (page >= n - local_pages)[None, None, :]) & eligible
    candidate = eligible & ~forced  # [nb, 1|Hkv, n]
    cand_scores = torch.where(candidate, scores, -torch.inf)
    # Stable descending sort: equal scores keep ascending page order, so ties go to the lower index.
    order = torch.sort(cand_scores, dim=-1, descending=True, stable=True).indices[..., :page_budget]
    chosen = torch.zeros(nb, Hkv, n, dtype=torch.bool, device=device)
    chosen.scatter_(-1, order, torch.gather(candidate.expand(nb, Hkv, n), -1, order))
    chosen |= forced
    counts = chosen.sum(-1).to(torch.int32)
    keyed = torch.where(chosen, page, n)  # unselected sort to the end
    page_idx = torch.sort(keyed, dim=-1).values[..., :K]
    page_idx = torch.where(page_idx == n, -1, page_idx).to(torch.int32)
    return PageSelection(page_idx, counts, B, n, dense)


def selection_mask(sel: PageSelection, C: int, past_len: int, page_size: int) -> torch.Tensor:
    """Boolean [Hkv, C, past_len]: which past tokens each query of each KV head may see (tests, tools)."""
    nb, Hkv, K = sel.page_idx.shape
    n = -(-past_len // page_size)
    pages = torch.zeros(nb, Hkv, n + 1, dtype=torch.bool, device=sel.page_idx.device)
    idx = torch.where(sel.page_idx < 0, n, sel.page_idx).long()
    pages.scatter_(-1, idx, True)
    pages = pages[..., :n]  # [nb, Hkv, n]
    tok = pages.repeat_interleave(page_size, dim=-1)[..., :past_len]  # [nb, Hkv, past_len]
    per_query = tok.repeat_interleave(sel.block_size, dim=0)[:C]  # [C, Hkv, past_len]
    return per_query.permute(1, 0, 2)


# ------------------------------------------------------------------------- reference attention
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


# ------------------------------------------------------------------------------------ autograd
def _sparse_fwd(backend, q, k, v, kv: PagedKV, sel: PageSelection, scale):
    args = (q, k, v, kv.k_cache, kv.v_cache, kv.block_table, kv.past_len, sel, scale, kv.q_doc_start)
    if backend == "triton":
        from .triton_sparse_attention import sparse_attention_fwd

        return sparse_attention_fwd(*args)
    return sparse_attention_fwd_ref(*args)


def _sparse_bwd(backend, dout, q, k, v, out, lse, kv: PagedKV, sel: PageSelection, scale):
    args = (dout, q, k, v, out, lse, kv.k_cache, kv.v_cache, kv.block_table, kv.past_len, kv.dk_cache, kv.dv_cache, sel,
            scale, kv.q_doc_start)
    if backend == "triton":
        from .triton_sparse_attention import sparse_attention_bwd

        return sparse_attention_bwd(*args)
    return sparse_attention_bwd_ref(*args)


class _SparseAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kv: PagedKV, sel: PageSelection, scale: float, backend: str, saved: tuple | None = None):
        out, lse = saved if saved is not None else _sparse_fwd(backend, q, k, v, kv, sel, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kv, ctx.sel, ctx.scale, ctx.backend = kv, sel, scale, backend
        return out if saved is None else out.clone()

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kv: PagedKV = ctx.kv
        dq, dk, dv = _sparse_bwd(ctx.backend, dout.contiguous(), q, k, v, out, lse, kv, ctx.sel, ctx.scale)
        if kv.own_block_table is not None:  # what later chunks stored for this chunk's own K/V
            n = k.shape[0]
            idx = kv.own_block_table.long()
            dk = dk + kv.dk_cache.index_select(0, idx).flatten(0, 1)[:n].to(dk.dtype)
            dv = dv + kv.dv_cache.index_select(0, idx).flatten(0, 1)[:n].to(dv.dtype)
        if kv.after_backward is not None:
            kv.after_backward()
        return dq, dk, dv, None, None, None, None, None


def sparse_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    sel: PageSelection,
    softmax_scale: float,
    backend: str = "torch",
    block_size: int = 4096,
    saved: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Differentiable attention of one chunk over its selected past pages plus its own K/V (causal).

    Same contract as :func:`oomb.ops.paged_attention.paged_attention` (dK/dV of the selected
    past pages are added into ``kv.dk_cache``/``kv.dv_cache`` in backward); a dense selection
    runs the dense path of ``backend`` unchanged; otherwise 'triton' runs
    :mod:`oomb.ops.triton_sparse_attention` and 'torch' the reference here. ``saved``: as in
    :func:`~oomb.ops.paged_attention.paged_attention` (the forward's earlier ``(out, lse)``).

    Returns:
        out: [C, Hq, D] in q's dtype.
    """
    if sel.dense:
        return paged_attention(q, k, v, kv, softmax_scale, backend, block_size, saved)
    return _SparseAttentionFunction.apply(q, k, v, kv, sel, softmax_scale, backend, saved)


def sparse_paged_attention_forward(q, k, v, kv: PagedKV, sel: PageSelection, softmax_scale: float, backend="torch", block_size=4096):
    """No-grad forward (Stage 1): (out [C, Hq, D], lse [Hq, C])."""
    if sel.dense:
        return paged_attention_forward(q, k, v, kv, softmax_scale, backend, block_size)
    return _sparse_fwd(backend, q, k, v, kv, sel, softmax_scale)


# ------------------------------------------------------------------------------ engine state
class SparseAttentionState:
    """Per-step sparse state of the engine: page representatives and the stored selections.

    Args:
        config: the engine's :class:`oomb.OOMBConfig` (sparse fields).
        num_layers, num_kv_heads, head_dim: model shape.
        seq_len: T in tokens.
        dtype: the model dtype (representatives use its accumulation dtype).
        device: where representatives and selections live.

    Selections are keyed by (chunk start token, layer); the engine drops a chunk's entries once
    its Stage-2 backward is done (``retain_selections=True`` keeps them, for tests and tools).
    """

    def __init__(self, config, num_layers, num_kv_heads, head_dim, seq_len, dtype, device, retain_selections=False):
        self.config = config
        self.reps = PageRepresentatives(
            num_layers, num_kv_heads, head_dim, -(-seq_len // config.page_size), config.page_size,
            config.sparse.score, acc_dtype_for(dtype), device,
        )
        self.selections: dict[tuple[int, int], PageSelection] = {}
        self.retain_selections = retain_selections
        self.page_size = config.page_size
        self.track_pages = False
        self.track_last = False  # the engine notes the last chunk's selections too (head-grained offload: note_tiles)
        # (start, layer) -> [host bool mask of the past pages read, its copy event (CUDA) or None, or the list]
        self._pages: dict[tuple[int, int], list] = {}
        self._pages_host: dict[int, torch.Tensor] = {}  # chunk start -> pinned [num_layers, n_past] bool (CUDA)
        self._num_layers = num_layers

    def write(self, layer: int, start: int, k: torch.Tensor) -> None:
        """Stage 1: summarise the chunk's keys [n, Hkv, D] (after the store wrote them)."""
        self.reps.write(layer, start, k)

    def selection(
        self, layer: int, start: int, q: torch.Tensor, q_doc_start: torch.Tensor | None, record_pages: bool = False
    ) -> PageSelection:
        """The stored selection of (chunk at ``start``, ``layer``); made from ``q`` the first time.

        Made in Stage 1 for every chunk but the last, whose Stage-1 pass the engine skips; that
        one is made in its first Stage-2 forward and reused by any recompute. With
        ``record_pages`` (the engine passes it in Stage 1) and :attr:`track_pages` set, a new
        selection's page union is recorded for :meth:`needed_pages`.
        """
        key = (start, layer)
        sel = self.selections.get(key)
        if sel is None:
            cfg, sp = self.config, self.config.sparse
            n = -(-start // cfg.page_size)
            with torch.no_grad():
                sel = select_pages(
                    q, self.reps.layer(layer, n), start, cfg.page_size, sp.page_budget, sp.sink_pages,
                    sp.local_pages, sp.block_size, sp.score, q_doc_start,
                )
            self.selections[key] = sel
            if record_pages and self.track_pages:
                self._record_pages(layer, start, sel)
        return sel

    def _record_pages(self, layer: int, start: int, sel: PageSelection) -> None:
        """Start copying the union of the past pages ``sel``'s attention reads to the host (no sync).

        The union is a bool mask over the ``n`` past pages, of a fixed size, so nothing on the host
        waits for it to be computed (``torch.unique`` would: its size is data-dependent). It holds
        every page of ``sel.page_idx`` (all heads and blocks), the sink and local pages included (they
        are part of it), and logical page 0 where a row is padded with -1: the PyTorch reference
        gathers padding entries from page 0 (then masks them), so page 0 must hold finite values.
        A dense selection (attention takes the dense path, reading every past page) marks every page.
        On CUDA the mask goes into a pinned [num_layers, n] buffer of the chunk with a non-blocking
        copy and an event; :meth:`needed_pages` waits for that event only.
        """
        n = -(-start // self.page_size)
        device = sel.page_idx.device
        if n == 0:
            self._pages[(start, layer)] = [[]]
            return
        with torch.no_grad():
            mask = torch.zeros(n, dtype=torch.bool, device=device)
            if n and sel.dense:
                mask.fill_(True)
            elif n and sel.page_idx.numel():
                mask[sel.page_idx.clamp(min=0).long().flatten()] = True
        if device.type != "cuda":
            self._pages[(start, layer)] = [mask, None]
            return
        buf = self._pages_host.get(start)
        if buf is None:
            buf = self._pages_host[start] = torch.empty((self._num_layers, n), dtype=torch.bool, pin_memory=True)
        buf[layer].copy_(mask, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        self._pages[(start, layer)] = [buf[layer], ev]

    def note_tiles(self, layer: int, start: int) -> None:
        """Let :meth:`needed_heads` give the store the selection of (chunk at ``start``, ``layer``) made in Stage 2
        (the last chunk's, with :attr:`track_last`). Its page union is not recorded: :meth:`needed_pages` stays
        None (all pages) for it, with no copy to the host and no wait on the device."""
        if self.track_pages and (start, layer) not in self._pages:
            self._pages[(start, layer)] = [None]

    def needed_pages(self, layer: int, start: int) -> list[int] | None:
        """Sorted logical past pages the attention of (chunk at ``start``, ``layer``) reads; None if unknown.

        Known for selections made in Stage 1 while :attr:`track_pages` is set (the engine sets it
        for an offloaded store with whole-layer staging, which stages only these pages in Stage 2);
        None otherwise, e.g. for the last chunk, whose selection is made in Stage 2. Never syncs the
        device: it waits only on the event of the Stage-1 copy of this mask (long done by Stage 2).
        """
        entry = self._pages.get((start, layer))
        if entry is None:
            return None
        if len(entry) == 1:
            return entry[0]
        mask, ev = entry
        if ev is not None:
            ev.synchronize()
        pages = torch.nonzero(mask).flatten().tolist()
        self._pages[(start, layer)] = [pages]
        return pages

    def needed_heads(self, layer: int, start: int) -> torch.Tensor | None:
        """int32 ``page_idx`` [nb, Hkv, K] (device, -1 padded) of the selection of (chunk at ``start``,
        ``layer``): the (page, KV head) tiles its attention reads; None if unknown or dense.

        Known, like :meth:`needed_pages`, for selections made in Stage 1 while :attr:`track_pages` is set, and
        for the last chunk's (made in its Stage-2 forward, before the store's view of that layer) once the engine
        has called :meth:`note_tiles` (:attr:`track_last`). Never syncs: the offload store turns it into a tile
        list on its copy stream.
        """
        if (start, layer) not in self._pages:
            return None
        sel = self.selections.get((start, layer))
        if sel is None or sel.dense:
            return None
        return sel.page_idx

    def release(self, start: int) -> None:
        """Forget the selections (and recorded page unions) of the chunk at ``start`` (unless retaining)."""
        if not self.retain_selections:
            for key in [key for key in self.selections if key[0] == start]:
                del self.selections[key]
            for key in [key for key in self._pages if key[0] == start]:
                del self._pages[key]
            self._pages_host.pop(start, None)
