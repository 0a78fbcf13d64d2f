"""Top-K page selection of sparse attention (docs/design.md §2.4), per (query block, KV head).

Let ``q_sum`` be the sum of the block's queries over its rows and the G query heads of the group. Page score:

* ``'mean'``:  ``q_sum · mean_k`` (softmax-free: a monotone stand-in for the attention mass of the group on the
  page);
* ``'quest'``: ``sum_d max(q_sum_d * min_d, q_sum_d * max_d)``, an upper bound on ``q_sum · k`` over the page's
  keys (Quest's bound, applied to the summed query).

Always kept: the first ``sink_pages`` pages (attention sink; Xiao et al. 2023, StreamingLLM) and the last
``local_pages`` past pages (local window), then the ``page_budget`` best-scoring of the others. Ties go to the
lower page index; only past pages can be chosen. With packed documents, pages wholly before the earliest document
of the block are never chosen (they are masked anyway), and the sink is the first pages of that document. When
every past page fits (``n_past_pages <= page_budget + sink_pages + local_pages``) every page is selected and
attention is exactly dense.

The result is a :class:`PageSelection`: int32 ``page_idx [n_qblocks, Hkv, K_max]`` of logical past pages,
ascending, padded with -1, and ``counts [n_qblocks, Hkv]``. It is made once in Stage 1 and reused unchanged by the
Stage-2 recompute and backward; no gradient flows through it. Kept between Stage 1 and Stage 2:
``L * (N - 1) * ceil(C / B) * Hkv * K * 4`` bytes (Qwen2.5-7B, chunk 4096, K = 73: 0.25 GiB at 1M tokens).

Shape legend: C own-chunk tokens, Hq query heads, Hkv KV heads, G = Hq // Hkv, D head dim, S page_size (tokens),
B block_size (queries per selection block), nb = ceil(C / B) query blocks, K = K_max selected pages per (block, KV
head), N chunks, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sparse_representatives import SCORES

__all__ = ["PageSelection", "select_pages", "selection_mask"]


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
    two-sort :func:`select_pages` (tests/ops/test_sparse_select_property.py).
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
    (tests/ops/test_sparse_select_property.py); it is faster on the CPU but was slower on an H200 for up to
    8,192 past pages (0.95 against 0.67 ms at 8,192; ``benchmarks/results/page_selection_h200.json``),
    so this is the torch path the engine uses (on CUDA with the Triton kernels it runs
    :func:`oomb.ops.triton.page_select.select_pages_triton`, bitwise the same selection).

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

