"""Where the KV pages live: all on the GPU, or a GPU pool of resident pages and staging buffers with the rest in
pinned host memory (docs/design.md §2.3; the layout is :mod:`oomb.engine.offload`'s).

The sizes here (segments, staging sets, resident pages, the Stage-1 shadow, the K/V stash) are what
:class:`~oomb.engine.offload.OffloadedKVStore` allocates, so :func:`choose_engine_tiering` (the engine) and
:func:`fit_tiering` (the engine and :mod:`oomb.planner`) size a pool the store then builds exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config.engine import HOST_FRACTION
from .shape import GiB, ModelShape, dtype_size
from .step import activation_bytes, page_bytes, saved_attention_bytes, sparse_headroom_bytes, sparse_state_bytes

__all__ = [
    "DEFAULT_SEGMENT_TOKENS",
    "DeviceMemory",
    "EngineTiering",
    "MemoryPlanError",
    "Tiering",
    "allocator_reserve_bytes",
    "choose_engine_tiering",
    "choose_staging_sets",
    "default_segment_pages",
    "fit_tiering",
    "gpu_page_budget_problem",
    "kv_stash_request_bytes",
    "kv_stash_reserve_bytes",
    "kv_stash_tiles",
    "min_gpu_pages",
    "resident_pages_for_budget",
    "resolve_segment_pages",
    "stage1_shadow_pages",
    "staging_pages",
]


class MemoryPlanError(ValueError):
    """A run that cannot fit the machine; the message says what is short, by how much, and what to change."""


def allocator_reserve_bytes(total_bytes: int) -> int:
    """GPU bytes a plan leaves free on a device of ``total_bytes`` for the caching allocator's rounding and
    fragmentation: 2 GiB or 3% of the device, whichever is more."""
    return max(2 * GiB, int(0.03 * total_bytes))


DEFAULT_SEGMENT_TOKENS = 32768
"""Default staging segment: 32K tokens (256 pages of 128), i.e. 2 x 256 x 768 KiB = 384 MiB for Qwen2.5-7B."""


def default_segment_pages(page_size: int) -> int:
    """Pages of the default staging segment (:data:`DEFAULT_SEGMENT_TOKENS` tokens, at least one page)."""
    return max(1, DEFAULT_SEGMENT_TOKENS // page_size)


def resolve_segment_pages(segment_pages: int | str | None, page_size: int) -> int | None:
    """``'auto'``/None -> :func:`default_segment_pages`; ``'layer'`` -> None (whole-layer staging); an int >= 1 -> itself.

    Raises:
        ValueError: anything else.
    """
    if segment_pages is None or segment_pages == "auto":
        return default_segment_pages(page_size)
    if segment_pages == "layer":
        return None
    if isinstance(segment_pages, bool) or not isinstance(segment_pages, int) or segment_pages < 1:
        raise ValueError(
            f"segment_pages must be a positive number of pages, 'auto' or 'layer'; got {segment_pages!r}"
        )
    return segment_pages


def staging_pages(n: int, R: int, segment_pages: int | None) -> int:
    """Pages of ONE staging buffer: the non-resident pages of a layer, or at most one segment of them."""
    return n - R if segment_pages is None else min(segment_pages, n - R)


MAX_AUTO_STAGING_SETS = 4
"""Most whole-layer staging sets :func:`choose_staging_sets` picks by itself."""

AUTO_STAGING_HOST_GROWTH = 0.10
"""How many more host pages per layer (a fraction) :func:`choose_staging_sets` accepts for a third or fourth set."""


def _residents(L: int, n: int, gpu_pages: int, K: int) -> int:
    """Resident pages per layer of a whole-layer pool of ``gpu_pages`` pages with ``K`` staging sets
    (``L*R + K*(n - R) <= gpu_pages``), -1 when even ``R = 0`` does not fit."""
    if gpu_pages < K * n:
        return -1
    return n if L <= K else min(n, (gpu_pages - K * n) // (L - K))


def choose_staging_sets(num_layers: int, pages_per_layer: int, gpu_pages: int, segment_pages: int | None,
                        requested: int | None = None) -> int:
    """Staging buffers a store of ``gpu_pages`` pool pages uses (``pages_per_layer`` pages per layer).

    Layer ``l`` stages into set ``l % K``, so with ``K`` sets a layer's staging follows the write-back of layer
    ``l + K`` (not ``l + 2``), and the top ``K`` layers keep their K/V from their Stage-2 forward to their backward.

    Segments: 2. Whole-layer staging: ``requested`` when given (``OffloadConfig.staging_sets``, or the planner's
    choice: it falls back to 2 where more sets would overflow the host budget), which must be below ``num_layers``
    (K whole-layer buffers of L <= K layers would cost as much as keeping every page on the GPU). Else the largest
    ``K < num_layers`` in ``(MAX_AUTO_STAGING_SETS, ..., 3)`` whose pool still keeps the host tier within
    ``AUTO_STAGING_HOST_GROWTH`` (10%) of its size with two sets (``n - R_K <= 1.1 * (n - R_2)``), else 2.
    Measured on the H200: at 256K tokens with every page offloaded, 4 sets took Stage 2 from 74.4 to 71.7 s for the
    same bytes (a layer's dK/dV staging no longer waits behind the write-back of layer ``l + 2``), and the 1M step
    from 291.8 s (2 sets) to 284.4 s (4 sets, a pool of about the same resident pages); the 1M Stage-2 excess grows
    about linearly with the host pages (~41 s at 3,876 per layer), so +10% host pages (~+4 s) stays below the gain.

    Raises:
        ValueError: ``requested`` not an integer >= 2, or not below ``num_layers`` with whole-layer staging.
    """
    if segment_pages is not None:
        return 2
    L, n = num_layers, pages_per_layer
    if requested is not None:
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 2:
            raise ValueError(f"staging_sets must be an integer >= 2, got {requested!r}")
        K = requested
        if K >= L and L > 2:
            raise ValueError(f"staging_sets={K} whole-layer staging buffers for a model of {L} layers cost as much as "
                             f"keeping every page on the GPU; use 2 to {L - 1}, or leave it unset to let oomb pick")
        return K
    R2 = _residents(L, n, gpu_pages, 2)
    if R2 < 0 or R2 >= n:  # below the minimum (the caller raises), or nothing to stage
        return 2
    for K in range(MAX_AUTO_STAGING_SETS, 2, -1):
        RK = _residents(L, n, gpu_pages, K)
        if L > K and RK >= 0 and n - RK <= (1 + AUTO_STAGING_HOST_GROWTH) * (n - R2):
            return K
    return 2


def min_gpu_pages(num_layers: int, pages_per_layer: int, segment_pages: int | None = None,
                  staging_sets: int | None = None) -> int:
    """Smallest GPU pool (pages) for ``pages_per_layer`` pages per layer: the fewest staging buffers (two, or
    ``staging_sets`` when given with whole-layer staging; of a whole layer when ``segment_pages`` is None, else of
    ``min(segment_pages, pages_per_layer)`` pages), or all pages if fewer."""
    K = staging_sets if segment_pages is None and staging_sets is not None else 2
    return min(K * staging_pages(pages_per_layer, 0, segment_pages), num_layers * pages_per_layer)


def gpu_page_budget_problem(num_layers: int, pages_per_layer: int, gpu_pages: int, segment_pages: int | None = None,
                            staging_sets: int | None = None) -> str | None:
    """Why a GPU pool of ``gpu_pages`` pages (a given ``gpu_page_budget``) can never stage ``pages_per_layer`` pages
    per layer, whatever the machine: it is below :func:`min_gpu_pages` (two staging buffers, or ``staging_sets``
    whole layers); None when it is not. 'problem; fix' in the config's field names: the one text of the store
    (:func:`resident_pages_for_budget`), :func:`fit_tiering` and the planner."""
    L, n = num_layers, pages_per_layer
    if gpu_pages >= L * n:
        return None
    K = choose_staging_sets(L, n, gpu_pages, segment_pages, staging_sets)
    need = min_gpu_pages(L, n, segment_pages, K)
    if gpu_pages >= need:
        return None
    if segment_pages is None:
        what = f"{K} layers of staging"
        fewer = f", lower staging_sets (2 needs {min_gpu_pages(L, n, segment_pages, 2):,})" if K > 2 else ""
    else:  # smaller segments need smaller buffers
        W = staging_pages(n, 0, segment_pages)
        what = f"two staging buffers of {W:,} pages"
        fewer = ", lower offload_segment_pages (the two buffers hold that many pages each)" if W > 1 else ""
    return (f"gpu_page_budget {gpu_pages:,} pages is below the {need:,} pages offload needs for {n:,} pages per layer "
            f"({what}); raise gpu_page_budget to {need:,} or more{fewer}, use a shorter seq_len, or leave "
            "gpu_page_budget out to let oomb size the pool")


def resident_pages_for_budget(
    num_layers: int, pages_per_layer: int, gpu_pages: int, segment_pages: int | None = None,
    staging_sets: int | None = None,
) -> int:
    """Resident pages per layer (R) that a GPU pool of ``gpu_pages`` pages affords.

    The pool holds ``L*R`` resident pages plus ``K`` staging buffers of ``W`` slots (none when
    ``R == n``): ``W = n - R`` and ``K`` = :func:`choose_staging_sets` with whole-layer staging
    (``segment_pages`` None; ``staging_sets``: a requested K, as there), else ``K = 2`` and
    ``W = min(segment_pages, n - R)``. Returns the largest such R.

    Raises:
        ValueError: if ``gpu_pages`` is below :func:`min_gpu_pages` (:func:`gpu_page_budget_problem` says why).
    """
    L, n = num_layers, pages_per_layer
    if gpu_pages >= L * n:
        return n
    problem = gpu_page_budget_problem(L, n, gpu_pages, segment_pages, staging_sets)
    if problem:
        raise ValueError(problem)
    K = choose_staging_sets(L, n, gpu_pages, segment_pages, staging_sets)
    if segment_pages is None:
        if L <= K:  # staging K layers costs as much as keeping them all
            return n
        return min(n, (gpu_pages - K * n) // (L - K))
    # L*R + 2*min(SP, n - R) grows with R (slope L or L - 2 >= 0 for L >= 2; L == 1 returned above).
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if L * mid + 2 * staging_pages(n, mid, segment_pages) <= gpu_pages:
            lo = mid
        else:
            hi = mid - 1
    return lo


def stage1_shadow_pages(num_layers: int, pages_per_layer: int, resident: int, pool_pages: int,
                        dtype: torch.dtype, grad_dtype: torch.dtype, partial: bool = False) -> int:
    """Host pages per layer whose K/V Stage 1 keeps on the GPU in the dK/dV bytes of the pool (whole-layer staging).

    Stage 1 computes no gradient, so the pool's dK/dV bytes (``pool_pages`` pages of ``grad_dtype``) are free
    until Stage 2 begins: they hold K/V (``dtype``) of host pages ``[R, R + Sh)`` of every layer, which Stage 1
    then reads in place instead of staging them (:mod:`oomb.engine.offload`, "Stage-1 shadow"). Returns
    ``Sh = n - R`` when ``floor(pool_pages * g / e / L) >= n - R`` (every host page fits), with ``e``/``g`` the
    element sizes of ``dtype``/``grad_dtype``; otherwise that floor if ``partial`` (the store's default,
    ``stage1_shadow_partial=True``), else 0; 0 when ``g`` is not a multiple of ``e``.
    """
    e, g = dtype.itemsize, grad_dtype.itemsize
    host = max(pages_per_layer - resident, 0)
    if g % e:
        return 0
    fits = pool_pages * (g // e) // max(num_layers, 1)
    return host if fits >= host else (fits if partial else 0)


def kv_stash_request_bytes(kv_stash_mib: int) -> int:
    """GPU bytes asked for the K/V stash: ``kv_stash_mib`` MiB (``OffloadConfig.kv_stash_mib``), an upper bound of
    what a store allocates (the planners keep it free for sparse offload).

    Raises:
        ValueError: ``kv_stash_mib`` not an integer >= 0.
    """
    if isinstance(kv_stash_mib, bool) or not isinstance(kv_stash_mib, int) or kv_stash_mib < 0:
        raise ValueError(f"kv_stash_mib must be an integer >= 0; got {kv_stash_mib!r} (0: no stash)")
    return kv_stash_mib << 20


def kv_stash_reserve_bytes(num_layers: int, pages_per_layer: int, num_kv_heads: int, head_dim: int, page_size: int,
                           dtype: torch.dtype, kv_stash_mib: int) -> int:
    """GPU bytes the planners keep free for the K/V stash of a whole-layer (sparse) store: what
    :func:`kv_stash_request_bytes` asks for, capped at every (page, KV head) tile of ``pages_per_layer`` pages in
    ``L - 2`` layers (what a store with two staging sets and every page on the host allocates at most; a store with
    more sets stashes for fewer layers).

    Raises:
        ValueError: a bad ``kv_stash_mib``.
    """
    want = kv_stash_request_bytes(kv_stash_mib)
    if not want:
        return 0
    # every tile of the L - 2 layers below the fewest staging sets: a bound for a store of any K >= 2
    tile = 2 * page_size * head_dim * dtype_size(dtype)
    return min(want, pages_per_layer * num_kv_heads * max(num_layers - 2, 0) * tile)


def kv_stash_tiles(num_layers: int, host_pages: int, num_kv_heads: int, head_dim: int, page_size: int,
                   dtype: torch.dtype, stash_bytes: int, staging_sets: int = 2) -> int:
    """Tiles per layer (C) of the K/V stash that ``stash_bytes`` buys (:mod:`oomb.engine.offload`, "K/V stash").

    The stash keeps, for each layer ``l < L - K`` (``K = staging_sets``: the top K layers keep their staging set),
    up to C staged (page, KV head) tiles of K and of V (``2 * S * D`` elements of ``dtype`` per tile), never more
    than the layer's host tiles (``host_pages * Hkv``). 0 when the bytes buy no tile or no layer needs one
    (L <= K, no host pages).
    """
    K = staging_sets
    if num_layers <= K or host_pages <= 0 or stash_bytes <= 0:
        return 0
    tile = 2 * page_size * head_dim * torch.empty((), dtype=dtype).element_size()
    return min(stash_bytes // ((num_layers - K) * tile), host_pages * num_kv_heads)



@dataclass(frozen=True)
class Tiering:
    """Where the KV pages go: ``offload`` False = all on the GPU; else a GPU pool of ``gpu_pages`` pages."""

    offload: bool
    gpu_pages: int | None
    resident_pages_per_layer: int
    staging_sets: int = 2  # staging buffers in the pool (choose_staging_sets)


def fit_tiering(L: int, n: int, pb: int, pool_budget: int, host_budget: int, offload: bool | str,
                gpu_page_budget: int | None, segment_pages: int | None = None,
                staging_sets: int | None = None, stash_bytes: int = 0) -> tuple[Tiering | None, str | None]:
    """Choose the tiering for n pages per layer, or (None, why not). ``segment_pages``: the staging
    segment (None: whole-layer staging). ``staging_sets``: requested whole-layer staging sets (None: picked from
    the pool by :func:`choose_staging_sets`, and 2 where more would overflow ``host_budget``).
    ``stash_bytes``: GPU bytes ``pool_budget`` keeps free for the K/V stash, which only an offloading store
    allocates: the all-on-GPU tiering may use them."""
    all_pages = L * n
    room = pool_budget + stash_bytes  # for every page on the GPU (no stash then)
    if offload is False or (offload == "auto" and gpu_page_budget is None and all_pages * pb <= room):
        if all_pages * pb > room:
            return None, (f"the KV store needs {all_pages * pb / GiB:.2f} GiB on the GPU but only "
                          f"{max(room, 0) / GiB:.2f} GiB of GPU memory is left for it; "
                          "turn offload on (offload='auto' or True)")
        return Tiering(False, None, n), None
    if gpu_page_budget is not None:
        pages = gpu_page_budget
        if pages * pb > pool_budget:
            return None, (f"gpu_page_budget {pages:,} pages = {pages * pb / GiB:.2f} GiB but only "
                          f"{max(pool_budget, 0) / GiB:.2f} GiB of GPU memory is left for KV pages; "
                          "lower gpu_page_budget, or leave it out to use the largest pool that fits")
    else:
        pages = min(max(pool_budget, 0) // pb, all_pages)
    need = min_gpu_pages(L, n, segment_pages, staging_sets)
    if pages < need:
        k = need // n  # the fewest staging sets (2, or as requested), each a whole layer
        what = f"{k} layers of staging" if segment_pages is None else "two staging segments"
        if gpu_page_budget is not None:  # the caller's budget is too small, not the GPU
            return None, gpu_page_budget_problem(L, n, pages, segment_pages, staging_sets)
        # The GPU is too small: what is left of it after the weights, states and activations cannot stage.
        shorter = ", or shorten the context" if segment_pages is None else ""
        return None, (f"offload needs at least {need:,} GPU pages ({need * pb / GiB:.2f} GiB: {what}) but only "
                      f"{max(pool_budget, 0) / GiB:.2f} GiB of GPU memory is left for KV pages after the weights, "
                      "gradients, optimizer states and activations; free GPU memory for them: "
                      f"use LoRA, checkpoint_layers or a smaller chunk_size{shorter}, or use a GPU with more memory")
    K = choose_staging_sets(L, n, pages, segment_pages, staging_sets)
    R = resident_pages_for_budget(L, n, pages, segment_pages, K)
    host = L * (n - R) * pb
    if host > host_budget and K > 2 and staging_sets is None:
        # More sets cost host pages: fall back to two (also where two do not fit either: the error then tells the
        # smallest host tier, the one to make room for).
        R = resident_pages_for_budget(L, n, pages, segment_pages, 2)
        K, host = 2, L * (n - R) * pb
    used = L * R + K * staging_pages(n, R, segment_pages)
    if host > host_budget:
        if gpu_page_budget is not None:  # the caller's pool sets the host tier: a larger one keeps more on the GPU
            return None, (f"the host tier needs {host / GiB:.2f} GiB of pinned memory but the budget is "
                          f"{host_budget / GiB:.2f} GiB; raise gpu_page_budget ({pages:,} pages keep {R:,} of {n:,} "
                          "pages per layer on the GPU), leave it out to use the largest pool that fits, shorten the "
                          "context or free host RAM")
        return None, (f"the host tier needs {host / GiB:.2f} GiB of pinned memory but the budget is "
                      f"{host_budget / GiB:.2f} GiB; shorten the context, free host "
                      f"RAM, or keep more pages on the GPU ({R:,} of {n:,} per layer now) with less GPU memory for "
                      "activations and weights: use LoRA, checkpoint_layers or a smaller chunk_size")
    return Tiering(R < n, used if R < n else None, R, K if R < n else 2), None



@dataclass(frozen=True)
class DeviceMemory:
    """What the GPU and the host report when an engine sizes its KV store (bytes)."""

    free_bytes: int  # the driver's free memory (torch.cuda.mem_get_info)
    total_bytes: int
    cached_bytes: int  # the allocator's cache: reserved less allocated
    allocated_bytes: int
    host_available_bytes: int


@dataclass(frozen=True)
class EngineTiering:
    """The store an engine builds: ``offload`` (an :class:`~oomb.engine.offload.OffloadedKVStore`) with a GPU pool of
    ``gpu_pages`` pages (None: the store's minimum) and ``staging_sets`` (None: picked from the pool), else every
    page on the device. ``budget``: the bytes read and reserved when the pool was sized from the device memory
    (None otherwise)."""

    offload: bool
    gpu_pages: int | None
    staging_sets: int | None
    budget: dict | None = None


def choose_engine_tiering(shape: ModelShape, config: Any, seq_len: int, dtype: torch.dtype, *,
                          segment_pages: int | str | None, backend: str, memory: DeviceMemory | None,
                          missing_grad_bytes: int = 0, host_fraction: float = HOST_FRACTION) -> EngineTiering:
    """The KV store of an engine (``config``: its :class:`~oomb.config.OOMBConfig`) about to allocate it for
    ``seq_len`` tokens of a model of ``shape`` in ``dtype``.

    Explicit settings win: ``offload.mode`` 'off' -> all on the device; a ``gpu_page_budget`` -> offload with it;
    without ``memory`` (a CPU device: a simulation) 'on' means the minimum GPU tier and 'auto' means no offload.
    With ``memory`` (CUDA) the pool budget is the memory free now (driver free + the allocator's cached bytes),
    less ``missing_grad_bytes`` (gradients not yet allocated), one chunk's activations (:func:`activation_bytes`
    with the ``backend`` the step runs) and a reserve (max(2 GiB, 3% of the GPU); sparse attention adds its state,
    :func:`sparse_headroom_bytes` and the K/V stash). Optimizer states allocated later are not seen: callers that
    know the optimizer (the CLI) should plan with :func:`oomb.planner.plan` and pass ``gpu_page_budget``.
    ``segment_pages``: the store's staging segment ('layer' for whole layers, as sparse attention needs).

    Raises:
        MemoryPlanError: with ``memory``, if not even the two staging buffers fit (two segments; two layers with
            sparse attention), or the host tier does not.
    """
    cfg = config
    off = cfg.offload
    if off.mode == "off":
        return EngineTiering(False, None, None)
    if off.gpu_page_budget is not None:
        return EngineTiering(True, off.gpu_page_budget, off.staging_sets)
    if memory is None:
        return EngineTiering(off.mode == "on", None, off.staging_sets)
    free, total, cached = memory.free_bytes, memory.total_bytes, memory.cached_bytes
    act = activation_bytes(shape, min(cfg.chunk_size, seq_len), dtype, cfg.checkpoint_layers, backend,
                           cfg.attention_block_size, cfg.loss_chunk_size, max(seq_len - cfg.chunk_size, 0),
                           keep_attention=cfg.checkpoint_attention == "keep")["total"]
    reserve = allocator_reserve_bytes(total)
    stash = 0
    if cfg.sparse:
        # Page representatives and stored selections live on the GPU for the whole step, and a 1M-token sparse +
        # offload step planned without them (and with the plain reserve) ran out of memory in Stage 2: count them,
        # and keep sparse_headroom_bytes free.
        reserve += sparse_state_bytes(shape, seq_len, cfg, dtype) + sparse_headroom_bytes(cfg.checkpoint_layers)
        # the K/V stash, when asked for (at most what the store would allocate); only an offloading store
        # allocates it (fit_tiering's stash_bytes)
        stash = kv_stash_reserve_bytes(shape.num_layers, -(-seq_len // cfg.page_size), shape.num_kv_heads,
                                       shape.head_dim, cfg.page_size, dtype, off.kv_stash_mib)
        reserve += stash
    pool_budget = free + cached - reserve - missing_grad_bytes - act
    budget = dict(seq_len=seq_len, free_bytes=int(free), cached_bytes=int(cached),
                  allocated_bytes=int(memory.allocated_bytes), reserve_bytes=int(reserve),
                  missing_grad_bytes=int(missing_grad_bytes), activation_bytes=int(act),
                  pool_budget_bytes=int(pool_budget))
    L, n = shape.num_layers, -(-seq_len // cfg.page_size)
    pb = page_bytes(shape, cfg.page_size, dtype)
    host_budget = int(memory.host_available_bytes * host_fraction)
    SP = resolve_segment_pages(segment_pages, cfg.page_size)

    def tier(pool: int, host: int):
        t, why = fit_tiering(L, n, pb, pool, host, off.enabled, None, SP, off.staging_sets, stash)
        if t is not None and t.offload:
            wbuf = 4 * cfg.chunk_size * shape.kv_dim * dtype_size(dtype)
            if SP is not None:  # the own-gradient buffers
                wbuf += 4 * cfg.chunk_size * shape.kv_dim * (8 if dtype == torch.float64 else 4)
            t, why = fit_tiering(L, n, pb, pool - wbuf, host, off.enabled, None, SP, off.staging_sets, stash)
        return t, why

    t = None
    if cfg.save_attention != "off":
        # Room for the kept attention outputs (save_attention): first with them; where they do not fit, or the
        # store would stage whole layers (sparse attention: the engine does not keep them then), without them.
        sa = saved_attention_bytes(L, shape.num_heads, shape.head_dim, seq_len, cfg.chunk_size, dtype_size(dtype),
                                   cfg.save_attention)
        t, _ = tier(pool_budget - sa["gpu"], host_budget - sa["host"])
        if t is not None and t.offload and SP is None:
            t = None
    if t is None:
        t, why = tier(pool_budget, host_budget)
    if t is None:
        err = MemoryPlanError(f"{seq_len:,} tokens do not fit: {why}")
        err.budget = budget  # what was read, for the engine's bug-report record
        raise err
    if off.mode == "on" and not t.offload:
        return EngineTiering(True, L * n, None, budget)  # asked for offload but everything fits: no host pages
    return EngineTiering(t.offload, t.gpu_pages, t.staging_sets if t.offload else None, budget)
