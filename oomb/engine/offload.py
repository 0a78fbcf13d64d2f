"""Two-tier KV page store: GPU-resident pages plus pinned host pages staged on a side stream.

DESIGN.md §2.3. A drop-in for :class:`~oomb.engine.kv_store.PagedKVStore` (same
engine interface) for sequences whose K/V and dK/dV do not fit on the GPU.

**Layout.** Page ``p`` of layer ``l`` (tokens ``p*S .. p*S+S-1``) lives

* on the GPU, in resident slot ``l * R + p``, when ``p < R`` (the first ``R``
  pages of EVERY layer are resident), else
* in host memory at ``k_host[l, p - R]`` (pinned on CUDA), and is copied into a
  staging buffer of the GPU pool when an attention needs it.

The GPU pool is ``[L*R resident pages | K*W staging slots]``: ``K`` staging
buffers of ``W`` pages (two with segments; with whole-layer staging
:func:`choose_staging_sets` takes up to four when the pool affords them).
Host pages of one layer are contiguous, so a staging is one copy per tensor
(K, V, dK, dV), never one copy per page.

**Segments (default).** The attention takes a layer's past in segments
(:mod:`oomb.ops.paged_attention`, "Segmented past": one kernel call per segment,
merged by log-sum-exp; the backward runs the segments in reverse with the final
lse), so staging holds one segment, not a layer: ``W = min(SP, n - R)`` for a
segment of ``SP`` pages (``segment_pages``; default 32K tokens, 256 pages of
128). For a past of ``P > R`` pages, segment 0 is pages ``[0, min(P, R+SP))``
(the resident prefix read in place plus the first ``SP`` host pages), segment
``i >= 1`` is ``[R + i*SP, min(P, R + (i+1)*SP))``; a past within ``R`` is one
resident segment. Each acquire hands the attention a block table for the buffer
the segment was staged into (a fixed table per buffer for segment 0, a view of
one int32 ramp for the others), so buffers can alternate freely. With a single
segment the kernel calls are exactly the unsegmented ones (bitwise). The
chunk's own stored dK/dV (backward only) go through two small own-gradient
buffers of one chunk each.

``segment_pages='layer'`` keeps whole-layer staging (``W = n - R``, ``K`` staging
sets, set ``l % K`` for layer ``l``, a block table fixed for the step), which the
sparse attention needs (it reads the past through one table). ``K`` is 2 to 4
(:func:`choose_staging_sets`); with segments it is 2.

**Why the earliest pages are resident.** Page ``p`` is read by every later
chunk, so the earliest pages are read most often: keeping a prefix of every
layer on the GPU removes the most traffic per resident byte and cuts the
traffic of every layer alike (so no layer's copy becomes the one the compute
waits for). A GPU budget of ``G`` pages buys the largest ``R`` with
``L*R + K*W <= G`` (:func:`resident_pages_for_budget`).

**GPU bytes** = ``(L*R + K*W)`` pages of K, V, dK, dV + two one-chunk own-gradient
buffers (dK, dV) + two one-chunk K/V write buffers + int32 block tables (4 bytes
per page of a layer). With segments nothing but the tables depends on the
context length: Qwen2.5-7B (28 layers, 4 KV heads, head dim 128, bf16 K/V, fp32
dK/dV, page 128, chunk 4096, R = 0) holds 2 x 256 pages x 768 KiB = 384 MiB of
staging + 32 MiB own-gradient + 16 MiB write buffers = 432 MiB at any length,
plus ~312 bytes of table per 10K tokens. (Whole-layer staging grows by ``K``
layers' pages per token: 12 KiB/token per set, ~126 MB per 10K tokens.)

**Schedule, segmented** (:class:`_SegmentSchedule`; L layers, chunk c)::

    Stage 1, chunk c, layer l:  write the chunk's new K/V (resident slots, or owned GPU buffer -> host, D2H);
                                segments 0..k-1 of l's past in order, each staged one segment ahead
    Stage 2 fwd, layer l:       segments 0..k-1 of l (the first two of layer 0 are still staged from the
                                backward of chunk c+1)
    [checkpointing: the recompute of layer l before its backward: segments 0..k-1 again]
    Stage 2 bwd, layer l:       own dK/dV staged (one backward ahead); segments k-1..0 with their dK/dV
                                (the last two are the forward's, their dK/dV added in place); after each
                                segment's backward its dK/dV are written back (D2H) before the buffer is reused

The next segment use is predicted from the engine's order (the schedule re-finds
its place if the engine departs from it) and staged into the buffer no kernel
is reading while the current segment computes; the next layer's first segment
is staged during the current layer's last. A prefetch never reads pages Stage 1
has not written yet. Host dK/dV pages are never zeroed on the host: a page whose
gradient was never written back is zero-filled in its staging slot instead of
copied. :func:`segment_traffic` counts the bytes of this schedule (the planner's
traffic).

**Schedule, whole-layer** (``segment_pages='layer'``; P past pages)::

    Stage 1, chunk c, layer l:   use K/V[0:P] of l;      prefetch K/V of l+1 (or layer 0 of chunk c+1)
                                 write the chunk's new K/V: resident slots, or owned GPU buffer -> host (D2H)
    Stage 2 fwd, layer l < L-1:  use K/V of l;           prefetch K/V of l+1
    Stage 2 fwd, layer L-1:      use K/V+dK/dV of L-1 (its backward is next); prefetch K/V+dK/dV of L-2
    Stage 2 bwd, layer l:        use K/V+dK/dV of l (incl. the chunk's own dK/dV pages);
                                 after its backward: write back dK/dV[0:P] (D2H), prefetch layer l-2 (or
                                 K/V of layer 0 of chunk c-1)

With per-layer checkpointing the recompute asks for a layer again right before
its backward; that view finds the pages already staged.

**Stage-1 shadow (whole-layer staging).** Stage 1 computes no gradient, so the
pool's dK/dV bytes (twice the K/V bytes for bf16 K/V and fp32 gradients) are
idle until Stage 2 begins. Stage 1 keeps the K/V of host pages ``[R, R + Sh)``
of every layer there too: each Stage-1 write of such a page also goes into its
shadow slot (a device copy; the D2H copy to the host tier, which Stage 2 reads,
is unchanged), and Stage-1 attention reads those pages in place through a
second block table over one view of the K (V) and dK (dV) bytes (K and dK share
one allocation), so Stage 1 stages only pages ``[R + Sh, P)``. ``Sh`` is
:func:`stage1_shadow_pages`: all host pages when they fit (Qwen2.5-7B at 1M
tokens on an H200: 3,876 of 3,876 per layer), else a prefix of them (``stage1_shadow_partial``,
default on; bitwise equal to no shadow on CPU and on an H200). The first
Stage-2 view zeroes every dK/dV page (which also clears the resident pages'
gradients that Stage-1 writes otherwise zero) before any staging into them.
``OOMB_OFFLOAD_STAGE1_SHADOW=0`` (or ``stage1_shadow = False``) turns it off.

**Sparse attention, page grain (``stage_grain='page'``): only the selected pages in Stage 2.** A sparse (chunk, layer)
reads only the past pages of its selection (made in Stage 1, reused unchanged in
Stage 2). The engine gives the store a hook, :attr:`OffloadedKVStore.needed_pages`
``(layer, start) -> sorted list of logical past pages | None``: the union of the
selection's pages over blocks and heads (sink and local pages are part of it; page 0
too where a row is padded, since the PyTorch reference gathers padding from page 0
before masking it; every page for a dense selection), copied to pinned host memory
in Stage 1 so Stage 2 reads it without a device sync. None (unknown: Stage 1, the
last chunk, dense attention) stages the whole layer as above. With a list, the
Stage-2 uses of that (chunk, layer) copy K/V, and dK/dV, only of the needed host
pages (one copy per run of consecutive pages per tensor) plus the chunk's own
gradient pages, into the SAME slots (the block table does not change; other slots
hold whatever they held, and no kernel reads them), and after the backward write
back dK/dV of the needed pages only. Whether a host gradient page was ever written
back is tracked per page, so a needed page never written is zero-filled. The events
are the same as for whole layers. This Stage-2 traffic is data-dependent (the size
of the unions) and bounded by the whole-layer traffic that
:func:`oomb.planner.offload_traffic` estimates; equal when every selection is dense.

**Sparse attention: only the selected (page, KV head) tiles (default, ``stage_grain='head'``).** A
selection is per (query block, KV head), so a page is often read by one head only. With a
:attr:`OffloadedKVStore.needed_heads` hook (``(layer, start) -> page_idx | None``, the selection on
the device), a Stage-2 use of a (chunk, layer) moves only the tiles ``(page, head)`` that some
query block of that head selected (plus page 0 where a row is padded, and all heads of the chunk's
own gradient pages): K/V and dK/dV in, dK/dV back. The tile list is made on the host->device
stream from the selection (:func:`oomb.ops.page_gather.head_pairs`, no host sync), and the copies
are Triton kernels that read and write the pinned host tier directly (zero-copy;
:mod:`oomb.ops.page_gather`), run on the two copy streams with the same events as copies. Which
host tiles hold a written-back gradient is a device mask per (layer, page, head) that every
write-back updates; a never-written tile is zero-filled. Write-backs go out in pieces with an
event each, and the next dK/dV gather into the set follows them piece by piece. On an H200 the
kernels move 47 (in) / 48 (out) GB/s alone but only ~58 GB/s together (DMA: 55 / 55 / 92), and
the 1M-token step moved 75% fewer Stage-2 bytes than with whole layers (benchmarks/NOTES.md,
ninth session). ``stage_grain='page'`` (or ``OOMB_OFFLOAD_STAGE_GRAIN=page``, or a GPU that cannot
address pinned memory) uses the page unions below.

**K/V stash (head grain; opt-in: ``OOMB_OFFLOAD_KV_STASH_MIB``).** With ``K`` staging sets, a layer
``l < L - K`` loses its set to layer ``l + K`` between its Stage-2 forward and its backward, so the
backward reads the same K/V tiles over PCIe a second time (per selected host tile and chunk: K/V in for
the forward, K/V in again for the backward, dK/dV in and out; the K/V re-read is a quarter of the
host->device bytes). A stash of ``C`` tiles per layer (:func:`kv_stash_tiles`; ``[L - K, C, S, D]`` for K
and for V on the GPU) keeps the first ``C`` tiles of each forward's list
(:func:`~oomb.ops.page_gather.stash_head_tiles`, a device copy on the host->device stream right after
the gather); the backward use of that (chunk, layer), whose list begins with the same past tiles, puts
them back (:func:`~oomb.ops.page_gather.unstash_head_tiles`) and reads only the rest from the host
(``gather_head_pages(first=C)``). Every stash copy runs on the host->device stream, in issue order
with the stagings that read and refill it, so it needs no event of its own. ``stats['kv_stash_bytes']``
counts the bytes restored. The stash is allocated when the engine sets a ``needed_heads`` hook (sparse
attention), not for dense runs. The last chunk's forwards read whole-layer prefetches (its selection
does not exist yet when they are issued), so they fill no stash. The stash takes GPU memory that could
hold resident pages instead; the planners keep the requested MiB free for sparse runs.

**Ordering.** Copies run on two side CUDA streams, host->device (H2D) and
device->host (D2H), each in issue order; PCIe is full duplex, so a write-back
can overlap the next staging. Before a copy overwrites a staging buffer it
waits on an event the compute stream recorded after the last kernel that reads
it; before a kernel reads a buffer the compute stream waits on the event
recorded after the copy into it; a D2H write-back waits on an event recorded
after the kernels that produced the data. Between the two copy streams: an H2D
copy of dK/dV into a buffer waits for the last write-back out of it (its K/V
copies need not: a write-back reads only dK/dV slots), and an H2D copy reading
host pages of a layer waits for the last D2H copy into that layer's host pages
(Stage-1 writes and write-backs). New K/V of Stage 1 go through two owned GPU
buffers (the compute stream waits for the previous D2H out of a buffer before
refilling it), so no tensor of the autograd graph is ever read by a copy
stream. Host-side waits are never used for ordering. With whole-layer staging
the write-back of layer l and the staging of layer l-2 share a set: the
write-back goes out in ``writeback_pieces`` (8) pieces with an event each, and
each dK/dV copy of the staging waits only for the piece that read its slots, so
the staging follows the write-back piece by piece and both directions stay busy.
``OOMB_OFFLOAD_COPY_STREAMS=1`` puts both directions on one stream (the schedule
before 2026-12-01).

On CPU there are no streams: every copy runs synchronously where it is issued,
with the same schedule, so CPU tests check page placement, prefetch order and
lifetimes, and losses/gradients against PagedKVStore's. The stream calls go
through ``_CudaStreams`` / ``_SyncStreams``; tests substitute two simulated copy
streams that defer every copy as long as the events allow, which turns a
missing wait (compute-side, or between the copy streams) into wrong numbers on CPU.
"""

from __future__ import annotations

import bisect
import collections
import functools
import math
import os
import warnings
import weakref
from dataclasses import dataclass

import torch

from ..ops.page_gather import (
    DEFAULT_PROGRAMS,
    check_kernel_env,
    gather_head_pages,
    head_pairs,
    scatter_head_pages,
    stash_head_tiles,
    unstash_head_tiles,
)
from ..ops.paged_attention import PagedKV

__all__ = [
    "DEFAULT_SEGMENT_TOKENS",
    "OffloadedKVStore",
    "check_env",
    "default_segment_pages",
    "kv_stash_request_bytes",
    "kv_stash_reserve_bytes",
    "kv_stash_tiles",
    "min_gpu_pages",
    "resident_pages_for_budget",
    "resolve_segment_pages",
    "segment_traffic",
    "stage1_shadow_pages",
]

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


def _staging(n: int, R: int, segment_pages: int | None) -> int:
    """Pages of ONE staging buffer: the non-resident pages of a layer, or at most one segment of them."""
    return n - R if segment_pages is None else min(segment_pages, n - R)


def staging_sets(segment_pages: int | None) -> int:
    """The FEWEST staging buffers a store may use: 2 with segments; with whole-layer staging (``segment_pages``
    None) ``OOMB_OFFLOAD_STAGING_SETS`` if set (an integer >= 2), else 2. :func:`choose_staging_sets` picks how many
    a given pool uses. Layer ``l`` stages into set ``l % K``, so with ``K`` sets a layer's staging follows the
    write-back of layer ``l + K`` (not ``l + 2``), and the top ``K`` layers keep their K/V from their Stage-2
    forward to their backward.

    Raises:
        ValueError: a bad ``OOMB_OFFLOAD_STAGING_SETS``.
    """
    if segment_pages is not None:
        return 2
    return _env_int("OOMB_OFFLOAD_STAGING_SETS", 2, minimum=2, default_text="to let oomb pick 2 to 4 from the GPU pool")


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

    Segments: 2. Whole-layer staging: ``OOMB_OFFLOAD_STAGING_SETS`` when set; else ``requested`` when given
    (``OOMBConfig.offload_staging_sets``, or the planner's choice: it falls back to 2 where more sets would
    overflow the host budget); either must be below ``num_layers`` (K whole-layer buffers of L <= K layers
    would cost as much as keeping every page on the GPU). Else the largest ``K < num_layers`` in
    ``(MAX_AUTO_STAGING_SETS, ..., 3)`` whose pool still keeps the host tier within ``AUTO_STAGING_HOST_GROWTH``
    (10%) of its size with two sets (``n - R_K <= 1.1 * (n - R_2)``), else 2. Measured on the H200
    (benchmarks/NOTES.md, twelfth session): at 256K tokens with every page offloaded, 4 sets took Stage 2 from
    74.4 to 71.7 s for the same bytes (a layer's dK/dV staging no longer waits behind the write-back of layer
    ``l + 2``), and the 1M step from 291.8 s (2 sets, tenth session) to 284.4 s (4 sets, a pool of about the same
    resident pages; 279.2 s with the copy kernel's new shape too); the 1M Stage-2 excess grows about linearly with
    the host pages (~41 s at 3,876 per layer), so +10% host pages (~+4 s) stays below the gain.

    Raises:
        ValueError: a bad ``OOMB_OFFLOAD_STAGING_SETS`` or ``requested`` (not an integer >= 2), or either not
            below ``num_layers`` with whole-layer staging.
    """
    if segment_pages is not None:
        return 2
    L, n = num_layers, pages_per_layer
    env = os.environ.get("OOMB_OFFLOAD_STAGING_SETS") is not None
    if env or requested is not None:
        if env:
            K, where = staging_sets(None), "OOMB_OFFLOAD_STAGING_SETS"
        else:
            if not isinstance(requested, int) or isinstance(requested, bool) or requested < 2:
                raise ValueError(f"offload_staging_sets must be an integer >= 2, got {requested!r}")
            K, where = requested, "offload_staging_sets"
        if K >= L and L > 2:
            raise ValueError(f"{where}={K} whole-layer staging buffers for a model of {L} layers cost as much as "
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
                  staging_sets_: int | None = None) -> int:
    """Smallest GPU pool (pages) for ``pages_per_layer`` pages per layer: :func:`staging_sets` staging buffers
    (two, or ``OOMB_OFFLOAD_STAGING_SETS``, or ``staging_sets_`` when given with whole-layer staging; of a whole
    layer when ``segment_pages`` is None, else two of ``min(segment_pages, pages_per_layer)`` pages), or all
    pages if fewer."""
    K = staging_sets(segment_pages)
    if segment_pages is None and staging_sets_ is not None and os.environ.get("OOMB_OFFLOAD_STAGING_SETS") is None:
        K = staging_sets_
    return min(K * _staging(pages_per_layer, 0, segment_pages), num_layers * pages_per_layer)


def resident_pages_for_budget(
    num_layers: int, pages_per_layer: int, gpu_pages: int, segment_pages: int | None = None,
    staging_sets_: int | None = None,
) -> int:
    """Resident pages per layer (R) that a GPU pool of ``gpu_pages`` pages affords.

    The pool holds ``L*R`` resident pages plus ``K`` staging buffers of ``W`` slots (none when
    ``R == n``): ``W = n - R`` and ``K`` = :func:`choose_staging_sets` with whole-layer staging
    (``segment_pages`` None; ``staging_sets_``: a requested K, as there), else ``K = 2`` and
    ``W = min(segment_pages, n - R)``. Returns the largest such R.

    Raises:
        ValueError: if ``gpu_pages`` is below :func:`min_gpu_pages`.
    """
    L, n = num_layers, pages_per_layer
    if gpu_pages >= L * n:
        return n
    K = choose_staging_sets(L, n, gpu_pages, segment_pages, staging_sets_)
    need = min_gpu_pages(L, n, segment_pages, K)
    if gpu_pages < need:
        what = (f"{K} layers' staging" if segment_pages is None
                else f"two staging buffers of {_staging(n, 0, segment_pages)} pages")
        fewer = (", lower offload_staging_sets / OOMB_OFFLOAD_STAGING_SETS (2 needs "
                 f"{min_gpu_pages(L, n, segment_pages, 2):,})" if segment_pages is None and K > 2 else "")
        raise ValueError(
            f"a GPU page budget of {gpu_pages} pages cannot stage {n} pages per layer: offload needs at least "
            f"{need} pages on the GPU ({what}); raise gpu_page_budget{fewer} or shorten the sequence"
        )
    if segment_pages is None:
        if L <= K:  # staging K layers costs as much as keeping them all
            return n
        return min(n, (gpu_pages - K * n) // (L - K))
    # L*R + 2*min(SP, n - R) grows with R (slope L or L - 2 >= 0 for L >= 2; L == 1 returned above).
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if L * mid + 2 * _staging(n, mid, segment_pages) <= gpu_pages:
            lo = mid
        else:
            hi = mid - 1
    return lo


def stage1_shadow_pages(num_layers: int, pages_per_layer: int, resident: int, pool_pages: int,
                        dtype: torch.dtype, grad_dtype: torch.dtype, partial: bool = False) -> int:
    """Host pages per layer whose K/V Stage 1 keeps on the GPU in the dK/dV bytes of the pool (whole-layer staging).

    Stage 1 computes no gradient, so the pool's dK/dV bytes (``pool_pages`` pages of ``grad_dtype``) are free
    until Stage 2 begins: they hold K/V (``dtype``) of host pages ``[R, R + Sh)`` of every layer, which Stage 1
    then reads in place instead of staging them (module docstring, "Stage-1 shadow"). Returns
    ``Sh = n - R`` when ``floor(pool_pages * g / e / L) >= n - R`` (every host page fits), with ``e``/``g`` the
    element sizes of ``dtype``/``grad_dtype``; otherwise that floor if ``partial`` (the store's default:
    :attr:`OffloadedKVStore.stage1_shadow_partial`), else 0; 0 when ``g`` is not a multiple of ``e``.
    """
    e, g = dtype.itemsize, grad_dtype.itemsize
    host = max(pages_per_layer - resident, 0)
    if g % e:
        return 0
    fits = pool_pages * (g // e) // max(num_layers, 1)
    return host if fits >= host else (fits if partial else 0)


def _pool_pair(shape: tuple[int, ...], dtype: torch.dtype, grad_dtype: torch.dtype, device: torch.device):
    """One allocation holding a K (or V) pool and its dK (or dV) pool of ``shape`` -> ``(kv, grad, combined, base)``.

    ``combined`` views the whole allocation as ``dtype`` pages of ``shape[1:]``: slots ``[0, shape[0])`` are ``kv``,
    slots from ``base`` on alias ``grad``'s bytes (the Stage-1 shadow). ``combined`` is None when the sizes do not
    divide (the shadow is then off)."""
    P = shape[0]
    pe = 1
    for x in shape[1:]:
        pe *= x
    e, g = dtype.itemsize, grad_dtype.itemsize
    slot = pe * e
    align = slot * 64 // math.gcd(slot, 64)  # grad bytes start on a whole slot and 64 B
    kbytes = -(-P * slot // align) * align
    gbytes = P * pe * g
    if g % e:
        kv = torch.empty(shape, dtype=dtype, device=device)
        return kv, torch.empty(shape, dtype=grad_dtype, device=device), None, 0
    buf = torch.empty(kbytes + gbytes, dtype=torch.uint8, device=device)
    kv = buf[: P * slot].view(dtype).view(shape)
    grad = buf[kbytes:].view(grad_dtype).view(shape)
    combined = buf.view(dtype).view((-1,) + tuple(shape[1:]))
    return kv, grad, combined, kbytes // slot


@dataclass(frozen=True)
class _Use:
    """One use of a layer's pages: K/V of ``past`` pages, plus dK/dV of ``past + own`` pages if ``grad``.

    ``pages``: a :class:`_HeadsOf` (Stage 2, head grain: the selection's (page, KV head) tiles), or runs
    ``(a, e)`` of the host pages [a, e) (R <= a < e <= past, ascending) that the attention reads (Stage 2
    with a ``needed_pages`` hook); None: all of [R, past)."""

    layer: int
    start: int  # token offset of the chunk
    past: int  # past pages whose K/V are read
    own: int  # the chunk's own pages whose stored dK/dV are read (backward only)
    grad: bool
    pages: tuple[tuple[int, int], ...] | None = None


@dataclass
class _Tag:
    """What a staging set holds (``pages``/``grad_pages``: a :class:`_HeadsOf` (tiles), host-page runs staged,
    or None: all of [R, past))."""

    layer: int
    past: int
    kv: bool
    grad_start: int | None = None  # chunk whose dK/dV are staged (None: none)
    grad_own: int = 0
    pages: tuple[tuple[int, int], ...] | None = None
    grad_pages: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True)
class _HeadsOf:
    """A Stage-2 use's pages are the (page, KV head) tiles the selection of (its layer, chunk ``start``) reads,
    plus all heads of the chunk's ``own`` gradient pages (head-grained staging)."""

    start: int
    own: int


def _covers(have, need) -> bool:
    """Whether the host-page runs ``have`` (None: all) include every page of ``need`` (None: all); a
    :class:`_HeadsOf` covers only itself."""
    if have is None or have == need:
        return True
    if isinstance(have, _HeadsOf) and isinstance(need, _HeadsOf):
        return have.start == need.start  # the same selection's tiles (own pages are checked with the gradients)
    if need is None or isinstance(have, _HeadsOf) or isinstance(need, _HeadsOf):
        return False
    i = 0
    for a, e in need:
        while i < len(have) and have[i][1] <= a:
            i += 1
        if i == len(have) or have[i][0] > a or have[i][1] < e:
            return False
    return True


def _page_runs(pages) -> tuple[tuple[int, int], ...]:
    """Sorted distinct page indices -> runs ``(a, e)`` of consecutive pages [a, e)."""
    runs: list[list[int]] = []
    for p in pages:
        if runs and runs[-1][1] == p:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return tuple((a, e) for a, e in runs)


def _coalesce_runs(
    runs: tuple[tuple[int, int], ...], lo: int, hi: int, merge_gap: int, whole_fraction: float, max_runs: int
) -> tuple[tuple[int, int], ...] | None:
    """Page runs of a Stage-2 staging made cheap to copy; None: stage the whole span [lo, hi).

    Runs separated by at most ``merge_gap`` pages are merged (copying a short gap costs less than
    the extra copy calls: one page of K, V, dK, dV of a 7B layer is 768 KiB, ~15 us over PCIe 5,
    about one copy call's overhead). If the merged runs still cover at least ``whole_fraction``
    of [lo, hi), or there are more than ``max_runs`` of them, the whole span is staged: one
    contiguous copy per tensor moves it at full bandwidth, while thousands of short copies do not
    (a 1M-token sparse step whose unions covered most of the past ran Stage 2 at ~5.5 s per chunk
    with per-run copies against ~1.3 s with whole layers; benchmarks/NOTES.md, 2026-12-01).
    """
    if not runs or hi <= lo:
        return runs
    merged: list[list[int]] = []
    for a, e in runs:
        if merged and a - merged[-1][1] <= merge_gap:
            merged[-1][1] = e
        else:
            merged.append([a, e])
    covered = sum(e - a for a, e in merged)
    if covered >= whole_fraction * (hi - lo) or len(merged) > max_runs:
        return None
    return tuple((a, e) for a, e in merged)


# ----------------------------------------------------------------------------- segmented staging
@dataclass(frozen=True)
class _SegUse:
    """One attention call's use of one past segment: K/V, plus dK/dV (the call's backward) if ``grad``."""

    layer: int
    start: int  # token offset of the chunk
    seg: int  # segment index (0 = the first, holding the resident pages)
    grad: bool


@dataclass
class _BufTag:
    """What a segment staging buffer holds: K/V of host pages [lo, kv_hi) of (layer, seg); dK/dV of
    [lo, grad_hi) as of the backward of the chunk at ``grad_start`` (None: none)."""

    layer: int
    seg: int
    kv_hi: int
    grad_start: int | None = None
    grad_hi: int = 0


class _SegmentSchedule:
    """Which host pages go into which of the two segment staging buffers, and when.

    Pure bookkeeping (no tensors): :class:`OffloadedKVStore` drives it with the calls the
    engine makes and performs the copies it asks for through ``hooks``; :func:`segment_traffic`
    drives it with the calls a step is predicted to make and only counts bytes. So the
    planner's traffic and the store's are one computation.

    Geometry for a call whose past is ``P`` pages (R resident, SP = segment pages): no segment
    when P == 0; one segment [0, P) when P <= R (resident, nothing staged); else
    ``k = ceil((P - R) / SP)`` segments, segment 0 = pages [0, min(P, R + SP)) (the resident
    prefix plus the first host pages), segment i >= 1 = [R + i*SP, min(P, R + (i+1)*SP)).
    Host pages of segment i: [R + i*SP, hi), staged into buffer slots [0, hi - R - i*SP).

    Prefetch: the step's calls are predicted (Stage 1 chunks 0..N-2, then per chunk from the
    last: forward of layers 0..L-1, then per layer from the top: [forward again with per-layer
    checkpointing,] backward), each call's segments in order, a backward's in reverse. With
    ``saved_attention`` the Stage-2 forwards of chunks 0..N-2 read no past (the engine's
    ``save_attention`` reuses Stage 1's outputs), so only their backwards are predicted. When a
    segment is acquired, the next predicted segment use that needs host pages is staged into
    the other buffer (or, for the backward right after a forward of the same segment, its
    dK/dV are added to the buffer the forward reads: an "upgrade"). A buffer holding K/V of
    [lo, hi) serves any later use of that segment needing [lo, hi' <= hi). If the engine's
    order departs from the prediction, the schedule re-finds its place (or stages on demand).

    Own gradient pages (the dK/dV later chunks stored for the chunk's own pages, read once by
    its backward) go through two small buffers (own buffer ``layer % 2``), staged when the
    previous backward starts (or ends, if that one uses the same own buffer).
    """

    def __init__(self, hooks, num_layers: int, page_size: int, chunk_size: int, resident: int, segment_pages: int,
                 checkpoint_layers: bool) -> None:
        self.hooks = hooks
        self.L, self.S, self.C, self.R, self.SP = num_layers, page_size, chunk_size, resident, segment_pages
        self.checkpoint_layers = checkpoint_layers
        self.saved_attention = False  # Stage 2 runs no attention forward for chunks 0..N-2 (save_attention)
        self.reset(None)

    # geometry
    def page_bounds(self, past_pages: int) -> list[tuple[int, int]]:
        """Page ranges [lo, hi) of the segments of a past of ``past_pages`` pages."""
        P, R, SP = past_pages, self.R, self.SP
        if P == 0:
            return []
        if P <= R:
            return [(0, P)]
        k = -(-(P - R) // SP)
        return [(0 if i == 0 else R + i * SP, min(P, R + (i + 1) * SP)) for i in range(k)]

    def host_range(self, use: _SegUse) -> tuple[int, int] | None:
        """Host pages [lo, hi) ``use`` reads (lo = R + seg*SP), or None when all its pages are resident."""
        hi = min(use.start // self.S, self.R + (use.seg + 1) * self.SP)
        lo = self.R + use.seg * self.SP
        return (lo, hi) if hi > lo else None

    def valid_upto(self, layer: int, seg: int, lo: int, hi: int) -> int:
        """End of the pages of [lo, hi) (one segment) whose host dK/dV were written back (a prefix)."""
        return min(max(self.written[layer].get(seg, 0), lo), hi)

    def page_valid(self, layer: int, page: int) -> bool:
        seg = (page - self.R) // self.SP
        return page < self.written[layer].get(seg, 0)

    # lifecycle
    def reset(self, seq_len: int | None) -> None:
        self.tags: list[_BufTag | None] = [None, None]
        self.busy: list[_SegUse | None] = [None, None]
        self.last_used = [0, 0]
        self.clock = 0
        self.written: list[dict[int, int]] = [{} for _ in range(self.L)]
        self.stored = [0] * self.L  # pages of each layer whose K/V are in the store (a prefetch reads no others)
        self.own_tag: list[tuple[int, int] | None] = [None, None]
        self.own_deferred: tuple[int, int] | None = None
        self.ahead: collections.deque = collections.deque()
        self.calls = self._predicted_uses(seq_len) if seq_len is not None else iter(())
        self.window = 8 + 4 * self.L * (len(self.page_bounds(-(-(seq_len or 0) // self.S))) + 1)

    def release_from(self, layer: int, keep: int) -> None:
        self.stored[layer] = min(self.stored[layer], keep)
        w = self.written[layer]
        for seg in w:
            w[seg] = min(w[seg], keep)

    def _predicted_uses(self, T: int):
        """Segment uses of one step needing host pages, in the engine's order (see the class docstring)."""
        L, C = self.L, self.C
        N = -(-T // C)

        def fwd(layer, s):
            for i in range(len(self.page_bounds(s // self.S))):
                u = _SegUse(layer, s, i, False)
                if self.host_range(u) is not None:
                    yield u

        def bwd(layer, s):
            for i in reversed(range(len(self.page_bounds(s // self.S)))):
                u = _SegUse(layer, s, i, True)
                if self.host_range(u) is not None:
                    yield u

        for c in range(N - 1):
            for layer in range(L):
                yield from fwd(layer, c * C)
        for c in range(N - 1, -1, -1):
            recompute = not (self.saved_attention and c < N - 1)  # its forwards read the past
            for layer in range(L if recompute else 0):
                yield from fwd(layer, c * C)
            for layer in range(L - 1, -1, -1):
                if self.checkpoint_layers and recompute:
                    yield from fwd(layer, c * C)
                yield from bwd(layer, c * C)

    def _peek(self, idx: int) -> _SegUse | None:
        while len(self.ahead) <= idx:
            nxt = next(self.calls, None)
            if nxt is None:
                return None
            self.ahead.append(nxt)
        return self.ahead[idx]

    def _advance(self, use: _SegUse) -> None:
        """Consume ``use`` from the predicted order (and whatever was predicted before it)."""
        for idx in range(self.window):
            u = self._peek(idx)
            if u is None:
                return
            if u == use:
                for _ in range(idx + 1):
                    self.ahead.popleft()
                return

    # buffers
    def _find(self, use: _SegUse, hi: int) -> int | None:
        for b, tag in enumerate(self.tags):
            if tag is not None and tag.layer == use.layer and tag.seg == use.seg and tag.kv_hi >= hi:
                return b
        return None

    def _missing(self, use: _SegUse, b: int | None, hi: int) -> tuple[bool, bool]:
        kv = b is None
        tag = None if b is None else self.tags[b]
        grad = use.grad and (tag is None or tag.grad_start != use.start or tag.grad_hi < hi)
        return kv, grad

    def _choose(self) -> int:
        """A buffer no kernel is reading: the least recently used one."""
        free = [b for b in (0, 1) if self.busy[b] is None]
        return min(free, key=lambda b: self.last_used[b])

    def _stage(self, b: int, use: _SegUse, lo: int, hi: int, kv: bool, grad: bool, why: str) -> None:
        if kv:
            self.tags[b] = _BufTag(use.layer, use.seg, hi)
        valid = None
        if grad:
            valid = self.valid_upto(use.layer, use.seg, lo, hi)
            self.tags[b].grad_start, self.tags[b].grad_hi = use.start, hi
        self.hooks.stage(b, use, lo, hi, kv, valid, why)

    def acquire(self, use: _SegUse) -> int | None:
        """Make ``use``'s host pages ready for the compute stream -> its buffer (None: all resident)."""
        rng = self.host_range(use)
        if rng is None:
            return None
        lo, hi = rng
        self._advance(use)
        b = self._find(use, hi)
        kv, grad = self._missing(use, b, hi)
        if kv or grad:
            if b is None:
                b = self._choose()
            elif self.busy[b] is not None:
                raise RuntimeError(f"segment buffer {b} is in use by {self.busy[b]} while {use} needs it: "
                                   "segments were acquired out of order")
            self._stage(b, use, lo, hi, kv, grad, "on_demand")
        self.hooks.wait(b)
        self.busy[b] = use
        self.clock += 1
        self.last_used[b] = self.clock
        self._prefetch()
        return b

    def _prefetch(self) -> None:
        """Stage the next predicted use that reads host pages (into a buffer no kernel is reading)."""
        nxt = self._peek(0)
        if nxt is None:
            return
        lo, hi = self.host_range(nxt)
        if hi > self.stored[nxt.layer]:
            return  # Stage 1 has not written those pages yet (the lookahead passed resident-only calls)
        b = self._find(nxt, hi)
        kv, grad = self._missing(nxt, b, hi)
        if not (kv or grad):
            return
        if b is None:
            if all(u is not None for u in self.busy):
                return
            b = self._choose()
        elif self.busy[b] is not None and self.busy[b].grad:
            return  # never add dK/dV under a backward that writes them (staged on demand instead)
        self._stage(b, nxt, lo, hi, kv, grad, "prefetched")

    def release(self, use: _SegUse, b: int | None) -> None:
        """The kernels of ``use`` are enqueued; a backward's dK/dV are written back to the host."""
        if b is None:
            return
        self.busy[b] = None
        lo, hi = self.host_range(use)
        if use.grad:
            w = self.written[use.layer]
            w[use.seg] = max(w.get(use.seg, 0), hi)
        self.hooks.release(b, use, lo, hi, use.grad)

    # own gradient pages
    def own_range(self, start: int, own_pages: int) -> tuple[int, int] | None:
        """Host pages of a chunk's own pages [P, P + own_pages) (None when all resident or none)."""
        P = start // self.S
        lo, hi = max(P, self.R), P + own_pages
        return (lo, hi) if hi > lo else None

    def _own_runs(self, layer: int, lo: int, hi: int) -> list[tuple[int, int, bool]]:
        runs: list[tuple[int, int, bool]] = []
        for p in range(lo, hi):
            ok = self.page_valid(layer, p)
            if runs and runs[-1][2] == ok:
                runs[-1] = (runs[-1][0], p + 1, ok)
            else:
                runs.append((p, p + 1, ok))
        return runs

    def _stage_own(self, layer: int, start: int, why: str) -> None:
        rng = self.own_range(start, self.C // self.S)
        if rng is None:
            return
        ob = layer % 2
        self.own_tag[ob] = (layer, start)
        self.hooks.stage_own(ob, layer, rng[0], self._own_runs(layer, *rng), why)

    def begin_backward(self, layer: int, start: int, own_pages: int) -> None:
        """The backward of (chunk at ``start``, ``layer``) starts: its own gradient pages ready, the next one's staged."""
        if self.own_range(start, own_pages) is not None:
            ob = layer % 2
            if self.own_tag[ob] != (layer, start):
                self._stage_own(layer, start, "on_demand")
            self.hooks.wait_own(ob)
        nxt = (layer - 1, start) if layer > 0 else ((self.L - 1, start - self.C) if start > 0 else None)
        self.own_deferred = None
        if nxt is not None and self.own_range(nxt[1], self.C // self.S) is not None:
            if nxt[0] % 2 != layer % 2:
                self._stage_own(*nxt, "prefetched")
            else:
                self.own_deferred = nxt  # its buffer is this backward's: after it

    def end_backward(self, layer: int, start: int) -> None:
        """The backward has read its own gradient pages."""
        self.hooks.own_read(layer % 2)
        if self.own_deferred is not None:
            nxt, self.own_deferred = self.own_deferred, None
            self._stage_own(*nxt, "prefetched")


class _CountingHooks:
    """Hooks of :class:`_SegmentSchedule` that only count bytes (the planner's view of a step)."""

    def __init__(self, kv_page_bytes: int, grad_page_bytes: int) -> None:
        self.kvb, self.gb = kv_page_bytes, grad_page_bytes
        self.h2d = self.d2h = 0

    def stage(self, b, use, lo, hi, kv, valid, why):
        if kv:
            self.h2d += (hi - lo) * self.kvb
        if valid is not None:
            self.h2d += (valid - lo) * self.gb

    def wait(self, b):
        pass

    def release(self, b, use, lo, hi, writeback):
        if writeback:
            self.d2h += (hi - lo) * self.gb

    def stage_own(self, ob, layer, lo, runs, why):
        self.h2d += sum(e - a for a, e, ok in runs if ok) * self.gb

    def wait_own(self, ob):
        pass

    def own_read(self, ob):
        pass


def segment_traffic(
    num_layers: int, seq_len: int, chunk_size: int, page_size: int, resident_pages_per_layer: int,
    segment_pages: int, checkpoint_layers: bool, kv_page_bytes: int, grad_page_bytes: int, simulate: bool | None = None,
    saved_attention: bool = False,
) -> tuple[int, int]:
    """(host->device, device->host) bytes of the segment staging of one step (Stage-1 writes excluded).
    ``*_page_bytes``: one page of one layer, K+V and dK+dV. ``saved_attention``: the engine keeps Stage 1's
    attention outputs, so the Stage-2 forwards of chunks 0..N-2 read no past (always simulated).

    ``simulate`` True runs :class:`_SegmentSchedule` over the step's predicted calls (exact by
    construction; time grows with (T / chunk) x (T / segment)); False uses the closed form below,
    which a test checks against the simulation over many small configurations; None (default):
    the closed form for L >= 3 layers, the simulation otherwise.

    Closed form (L >= 3), chunk c with H = max(c*C/S - R, 0) host pages in k = ceil(H / SP)
    segments, ``first2``/``last2`` = host pages of its first/last two segments:

    * Stage 1 (c < N-1): K/V of every host page, every layer.
    * Stage-2 forward: the same, less layer 0's first two segments (still staged from the
      backward of chunk c+1; with k = 1 both for c and c+1 also layer 1's segment); chunk N-1
      saves nothing.
    * Stage-2 backward K/V: without checkpointing L*H less ``last2`` (k >= 2; the top layer's
      last two segments are still staged from its forward) or 2H (k = 1: layers L-1 and L-2);
      with checkpointing the recompute stages L*H less 2H (k = 1) or H (k = 2), and each
      backward L*(H - last2) (its last two segments are left by its recompute).
    * dK/dV: every backward stages its host pages (c < N-1; chunk N-1's are zero-filled) and its
      own pages beyond R (c < N-1), and writes its host pages back.
    """
    L, C, S, R, SP = num_layers, chunk_size, page_size, resident_pages_per_layer, segment_pages
    if simulate is None:
        simulate = L < 3 or saved_attention
    if not simulate:
        N = -(-seq_len // C)
        n = C // S
        H = [max(c * n - R, 0) for c in range(N)]
        k = [-(-h // SP) for h in H]
        kv = g = d2h = 0
        for c in range(N):
            h, kc = H[c], k[c]
            own = max(c * n + n - max(c * n, R), 0) if c < N - 1 else 0
            if c < N - 1:
                kv += L * h  # Stage 1
                g += L * h + L * own
            d2h += L * h
            if h == 0:
                continue
            first2 = min(h, 2 * SP)
            last2 = h if kc <= 2 else h - (kc - 2) * SP
            save_fwd = 0
            if c < N - 1:
                save_fwd = first2 + (h if kc == 1 and k[c + 1] == 1 else 0)
            kv += L * h - save_fwd
            if checkpoint_layers:
                kv += L * h - (2 * h if kc == 1 else h if kc == 2 else 0) + L * (h - last2)
            else:
                kv += L * h - (2 * h if kc == 1 else last2)
        return kv * kv_page_bytes + g * grad_page_bytes, d2h * grad_page_bytes
    hooks = _CountingHooks(kv_page_bytes, grad_page_bytes)
    sched = _SegmentSchedule(hooks, num_layers, page_size, chunk_size, resident_pages_per_layer, segment_pages,
                             checkpoint_layers)
    sched.saved_attention = saved_attention
    sched.reset(seq_len)
    L, C, S = num_layers, chunk_size, page_size
    N = -(-seq_len // C)

    def fwd(layer, s):
        for i in range(len(sched.page_bounds(s // S))):
            u = _SegUse(layer, s, i, False)
            sched.release(u, sched.acquire(u))

    for c in range(N - 1):
        for layer in range(L):
            sched.stored[layer] = (c + 1) * (C // S)  # the engine writes a chunk's pages before its attention
            fwd(layer, c * C)
    for c in range(N - 1, -1, -1):
        s = c * C
        own = 0 if c == N - 1 else C // S
        recompute = not (saved_attention and c < N - 1)
        for layer in range(L if recompute else 0):
            fwd(layer, s)
        for layer in range(L - 1, -1, -1):
            if checkpoint_layers and recompute:
                fwd(layer, s)
            sched.begin_backward(layer, s, own)
            for i in reversed(range(len(sched.page_bounds(s // S)))):
                u = _SegUse(layer, s, i, True)
                sched.release(u, sched.acquire(u))
            sched.end_backward(layer, s)
        if c < N - 1:
            for layer in range(L):
                sched.release_from(layer, s // S)
    return hooks.h2d, hooks.d2h


class _CudaStreams:
    """The two copy streams (host->device ``copy``, device->host ``d2h``) and the events that order them
    against the compute (current) stream and each other."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy = torch.cuda.Stream(device)
        # OOMB_OFFLOAD_COPY_STREAMS=1 puts both directions on one stream (serialised, as before 2026-12-01;
        # for A/B measurements and debugging). The events are the same either way.
        one = _env_choice("OOMB_OFFLOAD_COPY_STREAMS", ("1", "2"), "2") == "1"
        self.d2h = self.copy if one else torch.cuda.Stream(device)

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def record_compute(self) -> torch.cuda.Event:
        """An event after everything enqueued so far on the compute stream."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def compute_wait(self, ev: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(ev)

    def copy_wait(self, ev: torch.cuda.Event) -> None:
        self.copy.wait_event(ev)

    def record_copy(self, ev: torch.cuda.Event) -> None:
        ev.record(self.copy)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.copy):
            dst.copy_(src, non_blocking=True)

    def zero_(self, dst: torch.Tensor) -> None:
        with torch.cuda.stream(self.copy):
            dst.zero_()

    def d2h_wait(self, ev: torch.cuda.Event) -> None:
        self.d2h.wait_event(ev)

    def d2h_copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)

    def record_d2h(self, ev: torch.cuda.Event) -> None:
        ev.record(self.d2h)

    def h2d_run(self, fn) -> None:
        """Enqueue ``fn``'s work (kernels, e.g. a zero-copy gather) on the host->device stream."""
        with torch.cuda.stream(self.copy):
            fn()

    def h2d_alloc(self, fn) -> None:
        """Run ``fn`` now, allocating (``torch.empty`` only) from the host->device stream's memory."""
        with torch.cuda.stream(self.copy):
            fn()

    def h2d_keep(self, *tensors: torch.Tensor) -> None:
        """``tensors`` (made on another stream) stay allocated until the host->device work enqueued next has run."""
        for t in tensors:
            t.record_stream(self.copy)

    def d2h_run(self, fn, *tensors: torch.Tensor) -> None:
        """Enqueue ``fn``'s work on the device->host stream; ``tensors`` (made on another stream) stay
        allocated until it has run."""
        with torch.cuda.stream(self.d2h):
            fn()
        for t in tensors:
            t.record_stream(self.d2h)

    def synchronize(self) -> None:
        self.copy.synchronize()
        self.d2h.synchronize()


class _SyncStreams:
    """CPU: no streams; a copy runs where it is issued, events are no-ops."""

    asynchronous = False

    def event(self) -> None:
        return None

    def record_compute(self) -> None:
        return None

    def compute_wait(self, ev) -> None:
        pass

    def copy_wait(self, ev) -> None:
        pass

    def record_copy(self, ev) -> None:
        pass

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def zero_(self, dst: torch.Tensor) -> None:
        dst.zero_()

    def d2h_wait(self, ev) -> None:
        pass

    def d2h_copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record_d2h(self, ev) -> None:
        pass

    def h2d_run(self, fn) -> None:
        fn()

    def h2d_alloc(self, fn) -> None:
        fn()

    def h2d_keep(self, *tensors) -> None:
        pass

    def d2h_run(self, fn, *tensors) -> None:
        fn()

    def synchronize(self) -> None:
        pass


def _env_int(name: str, default: int, minimum: int = 1, default_text: str | None = None) -> int:
    """An integer >= ``minimum`` from the environment variable ``name`` (``default`` when unset; ``default_text``
    says what unsetting it means in the error, else "the default, {default}").

    Raises:
        ValueError: a value that is not such an integer (naming the variable).
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        unset = default_text or f"for the default, {default}"
        raise ValueError(f"{name} must be {what}; got {raw!r} (unset it {unset})")
    return value


def _env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """``os.environ[name]`` if it is one of ``choices``, ``default`` when unset.

    Raises:
        ValueError: any other value, naming the variable and the choices.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    if raw not in choices:
        opts = " or ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be {opts}; got {raw!r} (unset it for the default, {default!r})")
    return raw


def check_env() -> None:
    """Validate every ``OOMB_*`` environment knob of the offload store, its copy kernels and the engine now (the CLI
    calls it before loading anything, so a typo fails in a fraction of a second, also for runs that would not use
    the knob): ``OOMB_OFFLOAD_STAGE_GRAIN`` (head|page), ``OOMB_OFFLOAD_STAGE1_SHADOW`` (0|1),
    ``OOMB_OFFLOAD_COPY_STREAMS`` (1|2), ``OOMB_OFFLOAD_KV_STASH_MIB`` (>= 0), ``OOMB_OFFLOAD_STAGING_SETS`` (>= 2),
    ``OOMB_PAGE_GATHER_PROGRAMS`` (>= 1), ``OOMB_PAGE_GATHER_WARPS`` / ``OOMB_PAGE_GATHER_ELEMS`` (powers of two),
    ``OOMB_FUSED_WGRAD`` (0|1).

    Raises:
        ValueError: the first bad value, naming the variable.
    """
    _env_choice("OOMB_OFFLOAD_STAGE_GRAIN", ("head", "page"), "head")
    _env_choice("OOMB_OFFLOAD_STAGE1_SHADOW", ("0", "1"), "1")
    _env_choice("OOMB_OFFLOAD_COPY_STREAMS", ("1", "2"), "2")
    _env_choice("OOMB_FUSED_WGRAD", ("0", "1"), "1")
    _env_int("OOMB_OFFLOAD_KV_STASH_MIB", 0, minimum=0)
    staging_sets(None)
    _env_int("OOMB_PAGE_GATHER_PROGRAMS", DEFAULT_PROGRAMS)
    check_kernel_env()


def kv_stash_request_bytes() -> int:
    """GPU bytes asked for the K/V stash: ``OOMB_OFFLOAD_KV_STASH_MIB`` (else :attr:`OffloadedKVStore.kv_stash_mib`)
    MiB, an upper bound of what a store allocates (the planners keep it free for sparse offload).

    Raises:
        ValueError: a value that is not an integer >= 0.
    """
    return _env_int("OOMB_OFFLOAD_KV_STASH_MIB", OffloadedKVStore.kv_stash_mib, minimum=0) << 20


def kv_stash_reserve_bytes(num_layers: int, pages_per_layer: int, num_kv_heads: int, head_dim: int, page_size: int,
                           dtype: torch.dtype) -> int:
    """GPU bytes the planners keep free for the K/V stash of a whole-layer (sparse) store: what
    :func:`kv_stash_request_bytes` asks for, capped at every (page, KV head) tile of ``pages_per_layer`` pages in
    ``L - 2`` layers (what a store with two staging sets and every page on the host allocates at most; a store with
    more sets stashes for fewer layers).

    Raises:
        ValueError: a bad ``OOMB_OFFLOAD_KV_STASH_MIB`` / ``OOMB_OFFLOAD_STAGING_SETS``.
    """
    want = kv_stash_request_bytes()
    if not want:
        return 0
    # every tile of the L - 2 layers below the fewest staging sets: a bound for a store of any K >= 2
    tile = 2 * page_size * head_dim * torch.empty((), dtype=dtype).element_size()
    return min(want, pages_per_layer * num_kv_heads * max(num_layers - 2, 0) * tile)


def kv_stash_tiles(num_layers: int, host_pages: int, num_kv_heads: int, head_dim: int, page_size: int,
                   dtype: torch.dtype, stash_bytes: int, staging_sets: int = 2) -> int:
    """Tiles per layer (C) of the K/V stash that ``stash_bytes`` buys (module docstring, "K/V stash").

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


def _zero_copy_works(host: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether the tile kernels can address the pinned host tier from the GPU (a launch with no tiles; Triton
    checks every pointer argument). False on systems without unified addressing of page-locked memory."""
    try:
        pairs = torch.zeros(2, dtype=torch.int32, device=pool.device)
        gather_head_pages(pool, 0, host[0, :1], pairs, pairs[:1], backend="triton")
        return True
    except (ValueError, RuntimeError):
        return False


def _make_streams(device: torch.device):
    """Streams for a store on ``device`` (tests substitute a simulator here)."""
    return _CudaStreams(device) if device.type == "cuda" else _SyncStreams()


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool, pins: list[int]) -> torch.Tensor:
    """Host tensor of ``shape``; page-locked when ``pin`` (a CUDA device will copy from/to it).

    ``torch.empty(pin_memory=True)`` rounds every pinned block up to a power of two
    (PyTorch's CachingHostAllocator), which would waste up to half of host RAM at the sizes
    planned here, so the tensor is allocated pageable and registered with cudaHostRegister;
    its address is appended to ``pins``, which the owner unregisters with
    :func:`_unregister_host` when it is collected. Falls back to ``pin_memory=True`` (with a
    warning) if registration fails.
    """
    t = torch.empty(shape, dtype=dtype)
    if not pin or t.numel() == 0:
        return t
    nbytes = t.numel() * t.element_size()
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        code = int(getattr(err, "value", err))
    except Exception as exc:  # pragma: no cover - depends on the CUDA build
        err, code = exc, -1
    if code == 0:
        pins.append(t.data_ptr())
        return t
    warnings.warn(f"cudaHostRegister of {nbytes / 2**30:.1f} GiB failed ({err}); using pin_memory=True (rounded up to a power of two)")
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def _unregister_host(ptrs: list[int], tensors: list[torch.Tensor]) -> None:
    cudart = torch.cuda.cudart()
    for ptr in ptrs:
        cudart.cudaHostUnregister(ptr)
    tensors.clear()


class OffloadedKVStore:
    """K/V and fp32 dK/dV pages of one training sequence in two tiers (GPU + pinned host).

    Args:
        num_layers: decoder layers (L).
        num_kv_heads: KV heads per layer (Hkv).
        head_dim: D.
        page_size: tokens per page (S).
        max_seq_len: tokens the store is sized for; ``n = ceil(max_seq_len / S)`` pages per layer.
        dtype: K/V dtype (the model's).
        device: the compute device (``cuda`` or, for simulation, ``cpu``).
        chunk_size: the engine's chunk size in tokens (to predict the next chunk's pages).
        gpu_pages: GPU pool budget in pages (resident + staging; the own-gradient and write
            buffers come on top); ``None`` = the minimum (every page in the host tier, two staging
            buffers). See :func:`resident_pages_for_budget`.
        grad_dtype: dK/dV dtype; default float32 (float64 for a float64 model).
        trace: record every transfer in :attr:`trace` (tests).
        segment_pages: staging segment in pages (an int >= 1), ``'auto'`` (default:
            :func:`default_segment_pages`, 32K tokens) or ``'layer'`` (whole-layer staging: the
            attention reads a layer's whole past through one block table, as the sparse attention
            needs; GPU bytes then grow with the context).
        checkpoint_layers: the engine recomputes each layer's forward before its backward
            (per-layer checkpointing); only the prefetch order depends on it.
        staging_sets: whole-layer staging buffers (an integer >= 2), or None to pick them from the pool
            (:func:`choose_staging_sets`; ``OOMB_OFFLOAD_STAGING_SETS`` overrides both). Ignored with segments.

    Attributes:
        k_cache, v_cache: [L*R + K*W, S, Hkv, D] GPU pool (model dtype): resident pages, then ``K`` staging buffers
            (``staging_sets``: 2 with segments, 2 to 4 with whole layers, :func:`choose_staging_sets`).
        dk_cache, dv_cache: same shape, ``grad_dtype``.
        own_dk_cache, own_dv_cache: [2*O, S, Hkv, D] ``grad_dtype``, O = min(chunk pages, n - R):
            the own-gradient buffers (segmented staging only, else None); own_pages: O (0 without).
        k_host, v_host, dk_host, dv_host: [L, n - R, S, Hkv, D] host tier (pinned on CUDA).
        resident_pages_per_layer: R. staging_pages: W (per buffer): n - R with whole-layer staging,
            else min(segment_pages, n - R). segment_pages: the segment (None: whole layer).
        stats: bytes copied each way, stagings issued ahead ("prefetched") or at the point of use ("on_demand").
        needed_pages: None, or a callable ``(layer, start) -> sorted list[int] | None`` naming the logical
            past pages the attention of (``layer``, chunk at token ``start``) reads in Stage 2 (None:
            unknown, all). With whole-layer staging, Stage 2 then stages and writes back only those
            pages (see the module docstring); segmented staging ignores it. Set by the engine for
            sparse attention; not cleared by :meth:`reset`.
        needed_heads: None, or a callable ``(layer, start) -> int32 [nb, Hkv, K] | None``: the selection's
            ``page_idx`` (logical pages per query block and KV head, -1 padded; on the device) of that
            Stage-2 attention, None when unknown or dense. With whole-layer staging and
            :attr:`stage_grain` ``'head'`` it takes precedence over ``needed_pages``: Stage 2 stages and
            writes back only the (page, KV head) tiles the selection reads (module docstring).
        stage_grain: ``'head'`` or ``'page'`` (class default ``'head'``; env ``OOMB_OFFLOAD_STAGE_GRAIN``).
        stage1_shadow_pages: Sh, host pages per layer Stage 1 reads from the pool's dK/dV bytes instead of
            staging them (whole-layer staging; 0 when off or segmented; module docstring, "Stage-1 shadow").
        kv_stash_tiles: C, (page, KV head) K/V tiles per layer below L - 2 kept from a Stage-2 forward for
            that layer's backward (head grain only; 0 when off; module docstring, "K/V stash").

    Raises:
        ValueError: a budget below two staging buffers; a bad ``segment_pages``; a bad
            ``OOMB_OFFLOAD_STAGE_GRAIN`` / ``OOMB_OFFLOAD_STAGE1_SHADOW`` / ``OOMB_OFFLOAD_KV_STASH_MIB``.
    """

    #: Selected-page staging (``needed_pages``): runs at most this many pages apart are merged, and
    #: the whole non-resident past is staged when the merged runs cover ``stage_whole_fraction`` of
    #: it or number more than ``stage_max_runs`` (see :func:`_coalesce_runs`).
    stage_merge_gap_pages: int = 1
    stage_whole_fraction: float = 0.5
    stage_max_runs: int = 256
    #: Stage-2 staging grain of a sparse (chunk, layer) whose selection is known: ``'head'`` (default) moves
    #: only the (page, KV head) tiles of the selection (:mod:`oomb.ops.page_gather`: zero-copy kernels on
    #: CUDA, with the ``needed_heads`` hook); ``'page'`` moves whole pages of the selection's page union
    #: (runs, with the ``needed_pages`` hook). ``OOMB_OFFLOAD_STAGE_GRAIN`` overrides it per store.
    stage_grain: str = "head"
    #: Whole-layer staging: Stage 1 keeps the K/V of host pages in the pool's dK/dV bytes and reads them in place
    #: (module docstring, "Stage-1 shadow"); ``OOMB_OFFLOAD_STAGE1_SHADOW=0`` turns it off per store.
    stage1_shadow: bool = True
    #: ... also when the dK/dV bytes hold only a prefix of each layer's host pages (the rest staged as before).
    #: Bitwise equal to no shadow on CPU and on an H200 (benchmarks/NOTES.md, eleventh session).
    stage1_shadow_partial: bool = True
    #: Bytes (MiB) of the Stage-2 K/V stash (module docstring, "K/V stash"); 0: none. ``OOMB_OFFLOAD_KV_STASH_MIB``
    #: overrides it per store. Off by default until measured on a GPU.
    kv_stash_mib: int = 0

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        chunk_size: int,
        gpu_pages: int | None = None,
        grad_dtype: torch.dtype | None = None,
        trace: bool = False,
        segment_pages: int | str = "auto",
        checkpoint_layers: bool = False,
        staging_sets: int | None = None,
    ) -> None:
        if chunk_size % page_size:
            raise ValueError(f"chunk_size ({chunk_size}) must be a multiple of page_size ({page_size})")
        SP = resolve_segment_pages(segment_pages, page_size)
        # Settings from the environment are checked before anything is allocated (pinning takes ~35 s at 1M).
        env_grain = os.environ.get("OOMB_OFFLOAD_STAGE_GRAIN")
        self._grain = env_grain if env_grain is not None else self.stage_grain
        if self._grain not in ("head", "page"):
            where = "OOMB_OFFLOAD_STAGE_GRAIN" if env_grain is not None else "OffloadedKVStore.stage_grain"
            raise ValueError(f"{where} must be 'head' or 'page'; got {self._grain!r} "
                             f"(unset it for the default, 'head')")
        self.gather_programs = _env_int("OOMB_PAGE_GATHER_PROGRAMS", DEFAULT_PROGRAMS)
        check_kernel_env()  # OOMB_PAGE_GATHER_WARPS / OOMB_PAGE_GATHER_ELEMS
        stash_mib = _env_int("OOMB_OFFLOAD_KV_STASH_MIB", self.kv_stash_mib, minimum=0)
        self.num_layers = L = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = S = page_size
        self.chunk_size = chunk_size
        self.dtype = dtype
        self.grad_dtype = grad_dtype or (torch.float64 if dtype == torch.float64 else torch.float32)
        self.device = torch.device(device)
        self.max_pages_per_layer = n = -(-max_seq_len // S)
        self.num_pages = L * n  # logical pages, both tiers
        self.gpu_page_budget = min_gpu_pages(L, n, SP, staging_sets) if gpu_pages is None else gpu_pages
        self.resident_pages_per_layer = R = resident_pages_for_budget(L, n, self.gpu_page_budget, SP, staging_sets)
        self.segment_pages = SP
        self.segmented = SP is not None
        self.host_pages_per_layer = H = n - R
        self.staging_pages = W = _staging(n, R, SP)
        self.staging_sets = K = choose_staging_sets(L, n, self.gpu_page_budget, SP, staging_sets)
        self.gpu_pool_pages = L * R + K * W
        self._cuda = self.device.type == "cuda"

        shape = (self.gpu_pool_pages, S, num_kv_heads, head_dim)
        env_shadow = os.environ.get("OOMB_OFFLOAD_STAGE1_SHADOW")
        if env_shadow not in (None, "0", "1"):
            raise ValueError(f"OOMB_OFFLOAD_STAGE1_SHADOW must be 0 or 1; got {env_shadow!r} (unset it for the default, 1)")
        shadow_on = self.stage1_shadow if env_shadow is None else env_shadow == "1"
        self.stage1_shadow_pages = Sh = (
            stage1_shadow_pages(L, n, R, self.gpu_pool_pages, dtype, self.grad_dtype, self.stage1_shadow_partial)
            if shadow_on and not self.segmented and H > 0 else 0
        )
        # K and dK (V and dV) share one allocation, so that Stage 1 can read K/V pages kept in the (then unused)
        # dK/dV bytes through the same tensor as the pool (see "Stage-1 shadow" in the module docstring).
        self.k_cache, self.dk_cache, self._k1, self._shadow_base = _pool_pair(shape, dtype, self.grad_dtype, self.device)
        self.v_cache, self.dv_cache, self._v1, _ = _pool_pair(shape, dtype, self.grad_dtype, self.device)
        hshape = (L, H, S, num_kv_heads, head_dim)
        self._host_pins: list[int] = []
        self.k_host = self._host_empty(hshape, dtype)
        self.v_host = self._host_empty(hshape, dtype)
        self.dk_host = self._host_empty(hshape, self.grad_dtype)
        self.dv_host = self._host_empty(hshape, self.grad_dtype)
        if self._host_pins:
            fin = weakref.finalize(self, _unregister_host, list(self._host_pins), [self.k_host, self.v_host, self.dk_host, self.dv_host])
            fin.atexit = False  # the process's exit releases the pins anyway

        self.own_dk_cache = self.own_dv_cache = None
        self.own_pages = 0
        self._sched = None
        if not self.segmented:
            # Fixed block tables: layer l's page p -> resident slot or a slot of staging set l % K.
            table = torch.empty((L, n), dtype=torch.int32)
            for layer in range(L):
                table[layer, :R] = torch.arange(layer * R, layer * R + R, dtype=torch.int32)
                base = L * R + (layer % K) * W
                table[layer, R:] = torch.arange(base, base + W, dtype=torch.int32)
            self.block_table = table.to(self.device)
            # Stage 1 with a shadow: host pages [R, R + Sh) of layer l at slots shadow_base + l*Sh + (p - R) of
            # the _k1/_v1 views (the dK/dV bytes), the rest as in Stage 2.
            self._table1 = None
            if Sh:
                t1 = table.clone()
                base1 = self._shadow_base
                for layer in range(L):
                    t1[layer, R : R + Sh] = torch.arange(base1 + layer * Sh, base1 + (layer + 1) * Sh, dtype=torch.int32)
                self._table1 = t1.to(self.device)
        else:
            self.block_table = None
            # Segment 0 of layer l in buffer b: [l*R .. l*R+R-1 (resident), base(b) .. base(b)+W-1].
            first = torch.empty((2, L, R + W), dtype=torch.int32)
            for b in range(2):
                for layer in range(L):
                    first[b, layer, :R] = torch.arange(layer * R, layer * R + R, dtype=torch.int32)
                    first[b, layer, R:] = torch.arange(L * R + b * W, L * R + b * W + W, dtype=torch.int32)
            self._first_tables = first.to(self.device)
            # Segment i >= 1 (host pages from p0 = R + i*SP) in buffer b reads page p at slot
            # base(b) + p - p0: a view of this ramp starting at n + base(b) - p0 (entries before p0 unused).
            self._ramp = torch.arange(-n, self.gpu_pool_pages, dtype=torch.int32).to(self.device)
            O = min(chunk_size // S, H)
            oshape = (2 * O, S, num_kv_heads, head_dim)
            self.own_pages = O
            self.own_dk_cache = torch.empty(oshape, dtype=self.grad_dtype, device=self.device)
            self.own_dv_cache = torch.empty(oshape, dtype=self.grad_dtype, device=self.device)
            self._sched = _SegmentSchedule(self, L, S, chunk_size, R, SP, checkpoint_layers)

        # The copy stream and events; owned buffers for Stage-1 writes to the host tier (two,
        # alternating, one chunk each) when copies are asynchronous.
        self._streams = st = _make_streams(self.device)
        self._ready = [st.event() for _ in range(K)]  # copy into staging set s done
        self._free = [st.event() for _ in range(K)]  # readers of staging set s done
        self._wbuf_free = [st.event(), st.event()]  # D2H out of write buffer b done
        self._own_ready = [st.event(), st.event()]  # copy into own-gradient buffer b done
        self._own_free = [st.event(), st.event()]  # the backward reading own-gradient buffer b is enqueued
        # Device->host copies run on their own stream, concurrently with host->device ones (PCIe is
        # full duplex), so the two orders a single stream gave for free are events now: a copy INTO
        # staging set / buffer s waits for the last write-back OUT of it (_wb_buf[s]), and a copy
        # reading host pages of layer l waits for the last device->host copy into them (_wb_layer[l]).
        self._wb_buf = [None] * K
        self._wb_layer: list = [None] * L
        # Whole-layer staging writes a layer's dK/dV back in pieces (slot ranges with an event each), so
        # the dK/dV staging of the layer that reuses the set (two layers down) can follow the write-back
        # piece by piece instead of waiting for all of it; _wb_prev[s]: the write-backs before those.
        self._wb_pieces: list[list] = [[] for _ in range(K)]
        self._wb_prev = [None] * K
        if st.asynchronous and H > 0:
            wshape = (2, chunk_size // S, S, num_kv_heads, head_dim)
            self._wbuf_k = torch.empty(wshape, dtype=dtype, device=self.device)
            self._wbuf_v = torch.empty(wshape, dtype=dtype, device=self.device)
        else:
            self._wbuf_k = self._wbuf_v = None
        self.trace: list[tuple] | None = [] if trace else None
        self.needed_pages = None
        self.kv_stash_tiles = 0
        self._stash_k = self._stash_v = None
        self.needed_heads = None
        grain = self._grain
        if grain == "head" and self._cuda and not self.segmented and H > 0 and not _zero_copy_works(self.k_host, self.k_cache):
            warnings.warn("this GPU cannot read the pinned host tier directly (zero-copy); sparse offload stages whole "
                          "pages of each selection instead of (page, KV head) tiles (stage_grain='page')")
            grain = "page"
        self.stage_grain = grain
        # Whole-layer staging: which host (page, KV head) dK/dV tiles hold a written-back gradient, on the
        # device (head-grained stagings read it without a host sync; every write-back updates it).
        self._written = (torch.zeros((L, H, num_kv_heads), dtype=torch.bool, device=self.device)
                         if not self.segmented and H > 0 else None)
        # Device byte counters of head-grained copies: host->device, device->host, K/V restored from the stash.
        self._dev_bytes = torch.zeros(3, dtype=torch.int64, device=self.device) if self._written is not None else None
        # The K/V stash (module docstring): head-grained Stage-2 stagings of whole-layer staging only.
        C = (kv_stash_tiles(L, H, num_kv_heads, head_dim, S, dtype, stash_mib << 20, self.staging_sets)
             if grain == "head" and not self.segmented else 0)
        self.kv_stash_tiles = C  # allocated when a needed_heads hook is set (sparse attention), not before
        self.reset()

    @property
    def needed_heads(self):
        """The Stage-2 selection hook (see the class docstring); setting one allocates the K/V stash, if any."""
        return self._needed_heads

    @needed_heads.setter
    def needed_heads(self, hook) -> None:
        self._needed_heads = hook
        if hook is not None and self.kv_stash_tiles and self._stash_k is None:
            shape = (self.num_layers - self.staging_sets, self.kv_stash_tiles, self.page_size, self.head_dim)
            self._stash_k = torch.empty(shape, dtype=self.dtype, device=self.device)
            self._stash_v = torch.empty(shape, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ memory
    def _host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host tensor; page-locked on CUDA (see :func:`host_empty`)."""
        return host_empty(shape, dtype, self._cuda, self._host_pins)

    @staticmethod
    def pages_needed(num_layers: int, seq_len: int, page_size: int) -> int:
        """Logical pages (both tiers) for ``seq_len`` tokens over ``num_layers`` layers."""
        return num_layers * -(-seq_len // page_size)

    @property
    def nbytes(self) -> int:
        """GPU bytes of the store's page buffers: the pool (resident + staging, K, V, dK, dV), the own-gradient
        buffers and the write buffers. Block tables: :attr:`index_nbytes`."""
        tensors = [self.k_cache, self.v_cache, self.dk_cache, self.dv_cache]
        if self.own_dk_cache is not None:
            tensors += [self.own_dk_cache, self.own_dv_cache]
        if self._wbuf_k is not None:
            tensors += [self._wbuf_k, self._wbuf_v]
        if self._stash_k is not None:
            tensors += [self._stash_k, self._stash_v]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def index_nbytes(self) -> int:
        """GPU bytes of the int32 block tables (4 bytes per page of a layer, or per page with segments)."""
        tensors = [self.block_table] if self.block_table is not None else [self._first_tables, self._ramp]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def host_nbytes(self) -> int:
        """Host bytes of the host tier (K, V, dK, dV)."""
        return sum(t.numel() * t.element_size() for t in (self.k_host, self.v_host, self.dk_host, self.dv_host))

    def fits(self, seq_len: int) -> bool:
        """Whether a sequence of ``seq_len`` tokens fits in this store."""
        return -(-seq_len // self.page_size) <= self.max_pages_per_layer

    def page_location(self, layer: int, page: int) -> tuple[str, int]:
        """('gpu', resident slot) or ('host', index into ``k_host[layer]``) of page ``page`` of ``layer``."""
        R = self.resident_pages_per_layer
        return ("gpu", layer * R + page) if page < R else ("host", page - R)

    # --------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        """Forget every page (start of a step). Waits for copies still in flight from an aborted step."""
        self._streams.synchronize()
        L = self.num_layers
        self._pages = [0] * L  # pages stored per layer
        self._grad_valid = [0] * L  # host dK/dV valid for pages [R, _grad_valid) of each layer
        self._grad_extra: list[set[int]] = [set() for _ in range(L)]  # ... and for these pages (>= _grad_valid)
        self._runs_cache: dict[tuple[int, int], tuple[tuple[int, int], ...] | None] = {}
        K = self.staging_sets
        self._tag: list[_Tag | None] = [None] * K
        self._busy = [False] * K
        self._owner = [-1] * K  # layer whose use holds each staging set while busy
        self._pending: _Use | None = None
        self._inflight: dict[int, _Use] = {}
        self._seen_start: int | None = None
        self._seen_layers: set[int] = set()
        self._wbuf_next = 0
        self._seq_len: int | None = None
        self._stats = {"h2d_bytes": 0, "d2h_bytes": 0, "prefetched": 0, "on_demand": 0, "kv_stash_bytes": 0}
        self._pairs_cache: dict[tuple[int, int], tuple] = {}
        self._heads_used = [False] * L  # a head-grained write-back went into the layer's host dK/dV this step
        self._in_stage2 = False  # Stage 2 has begun this step (the Stage-1 shadow is gone: _begin_stage2)
        self._stash_key: list = [None] * self.num_layers  # chunk start of the K/V tiles layer l's stash holds
        if self._written is not None:
            self._written.zero_()
            self._dev_bytes.zero_()
        if self._sched is not None:
            self._sched.reset(None)
        if self.trace is not None:
            self.trace.clear()

    @property
    def stats(self) -> dict:
        """Bytes copied each way (``h2d_bytes``/``d2h_bytes``, head-grained tiles included), K/V bytes a backward
        took from the stash instead of the host (``kv_stash_bytes``) and stagings issued ahead (``prefetched``)
        or at the point of use (``on_demand``). Reading it after head-grained
        stagings waits for the copy streams (their byte counts are kept on the device)."""
        if self._dev_bytes is not None and any(self._heads_used):
            self._streams.synchronize()
            h2d, d2h, stash = self._dev_bytes.tolist()
            self._dev_bytes.zero_()
            self._stats["h2d_bytes"] += h2d
            self._stats["d2h_bytes"] += d2h
            self._stats["kv_stash_bytes"] += stash
        return self._stats

    @property
    def supports_saved_attention(self) -> bool:
        """Whether a step may skip the Stage-2 attention forwards (``save_attention``): with segmented
        staging the attention acquires each segment itself; whole-layer staging stages in the view."""
        return self.segmented

    def set_saved_attention(self, on: bool) -> None:
        """Tell the segment schedule whether this step's Stage-2 forwards of chunks 0..N-2 read the past
        (call after :meth:`begin_step`, before the step's first attention).

        Raises:
            RuntimeError: ``on`` with whole-layer staging (:attr:`supports_saved_attention` False).
        """
        if on and not self.segmented:
            raise RuntimeError("save_attention needs segmented staging (whole-layer staging stages in attention_view)")
        if self._sched is not None and self._sched.saved_attention != on:
            self._sched.saved_attention = on
            self._sched.reset(self._seq_len)

    def begin_step(self, seq_len: int) -> None:
        """Tell the store the step's length (bounds the prefetch of a next chunk)."""
        if not self.fits(seq_len):
            raise ValueError(f"{seq_len} tokens do not fit a store sized for {self.max_pages_per_layer * self.page_size}")
        self._seq_len = seq_len
        if self._sched is not None:
            self._sched.reset(seq_len)

    @property
    def num_free_pages(self) -> int:
        return self.num_pages - sum(self._pages)

    def num_layer_pages(self, layer: int) -> int:
        return self._pages[layer]

    def release_from(self, layer: int, start: int) -> None:
        """Forget the pages of tokens [start, end) of ``layer`` (start page-aligned)."""
        S = self.page_size
        if start % S:
            raise ValueError(f"release_from: start {start} is not page-aligned (page_size {S})")
        keep = start // S
        self._pages[layer] = min(self._pages[layer], keep)
        self._grad_valid[layer] = min(self._grad_valid[layer], keep)
        extra = self._grad_extra[layer]
        if extra:
            extra.difference_update([p for p in extra if p >= keep])
        for key in [key for key in self._runs_cache if key[0] == layer and key[1] >= start]:
            del self._runs_cache[key]
        for key in [key for key in self._pairs_cache if key[0] == layer and key[1] >= start]:
            del self._pairs_cache[key]
        R = self.resident_pages_per_layer
        if self._written is not None and keep - R < self.host_pages_per_layer:
            written = self._written
            self._streams.d2h_run(lambda: written[layer, max(0, keep - R):].fill_(False))
            self._wb_layer[layer] = self._d2h_event()
        if self._sched is not None:
            self._sched.release_from(layer, keep)
        if self.trace is not None:
            self.trace.append(("release", layer, keep))

    # ---------------------------------------------------------------- writes
    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a chunk's K/V ([n, Hkv, D] each) for ``layer`` at token ``start`` (page-aligned, appended).

        Resident pages are written on the compute stream and their gradient pages zeroed;
        host pages go through an owned GPU buffer and a D2H copy on the side stream.

        Raises:
            ValueError: if ``start`` is not page-aligned or does not follow the stored tokens.
            RuntimeError: if the layer would hold more pages than the store was sized for.
        """
        S, R = self.page_size, self.resident_pages_per_layer
        if start % S != 0 or start // S != self._pages[layer]:
            raise ValueError(
                f"layer {layer}: write at token {start} must be page-aligned and follow the "
                f"{self._pages[layer] * S} tokens already stored"
            )
        n = k.shape[0]
        p0 = start // S
        p1 = p0 + -(-n // S)
        if p1 > self.max_pages_per_layer:
            raise RuntimeError(f"layer {layer} would hold {p1} pages, more than the {self.max_pages_per_layer} this store was sized for")
        Hkv, D = self.num_kv_heads, self.head_dim
        if p0 < R:  # resident prefix
            q1 = min(p1, R)
            nt = min(n, (q1 - p0) * S)
            a, b = layer * R + p0, layer * R + q1
            self.k_cache[a:b].view(-1, Hkv, D)[:nt] = k[:nt]
            self.v_cache[a:b].view(-1, Hkv, D)[:nt] = v[:nt]
            if not self.stage1_shadow_pages:  # else Stage 2 zeroes all dK/dV when it begins (_begin_stage2)
                self.dk_cache[a:b].zero_()
                self.dv_cache[a:b].zero_()
        if p1 > R:  # host tier
            a = max(p0, R)
            t0 = (a - p0) * S
            nt = n - t0
            hk = self.k_host[layer, a - R : p1 - R].view(-1, Hkv, D)[:nt]
            hv = self.v_host[layer, a - R : p1 - R].view(-1, Hkv, D)[:nt]
            st = self._streams
            if self._wbuf_k is None:
                hk.copy_(k[t0:])
                hv.copy_(v[t0:])
            else:
                if nt > self._wbuf_k.shape[1] * S:
                    raise RuntimeError(f"a write of {nt} tokens exceeds the {self._wbuf_k.shape[1] * S}-token write buffer (chunk_size)")
                b = self._wbuf_next
                self._wbuf_next ^= 1
                st.compute_wait(self._wbuf_free[b])  # the previous D2H out of this buffer is done
                wk = self._wbuf_k[b].view(-1, Hkv, D)[:nt]
                wv = self._wbuf_v[b].view(-1, Hkv, D)[:nt]
                wk.copy_(k[t0:])
                wv.copy_(v[t0:])
                st.d2h_wait(st.record_compute())  # the buffer is filled
                st.d2h_copy_(hk, wk)
                st.d2h_copy_(hv, wv)
                st.record_d2h(self._wbuf_free[b])
                self._wb_layer[layer] = self._d2h_event()
            self._stats["d2h_bytes"] += 2 * nt * Hkv * D * k.element_size()
            Sh = self.stage1_shadow_pages
            if Sh and not self._in_stage2 and a < R + Sh:  # and into the Stage-1 shadow (compute stream)
                e1 = min(p1, R + Sh)
                ns = min(nt, (e1 - a) * S)
                s1 = self._shadow_base + layer * Sh + (a - R)
                self._k1[s1 : s1 + e1 - a].view(-1, Hkv, D)[:ns] = k[t0 : t0 + ns]
                self._v1[s1 : s1 + e1 - a].view(-1, Hkv, D)[:ns] = v[t0 : t0 + ns]
            if self.trace is not None:
                self.trace.append(("write_host", layer, a, p1))
        self._pages[layer] = p1
        if self._sched is not None:
            self._sched.stored[layer] = p1

    # ------------------------------------------------- device->host ordering (two copy streams)
    def _d2h_event(self):
        """A new event after everything enqueued so far on the device->host stream."""
        ev = self._streams.event()
        self._streams.record_d2h(ev)
        return ev

    def _wrote_back(self, buf: int, layer: int) -> None:
        """Write-backs out of staging set / buffer ``buf`` into host pages of ``layer`` are enqueued."""
        ev = self._d2h_event()
        self._wb_buf[buf] = ev
        self._wb_layer[layer] = ev

    writeback_pieces = 8
    """Whole-layer staging: a layer's dK/dV write-back is split into about this many pieces (one event each)."""

    def _write_back_pieces(self, s: int, layer: int, base: int, runs: list[tuple[int, int]]) -> None:
        """D2H of the dK/dV slots ``runs`` ([x, y) offsets from ``base``) of set ``s`` into host pages of ``layer``
        (page R + x at slot base + x), in about ``writeback_pieces`` pieces, each followed by an event."""
        st = self._streams
        total = sum(y - x for x, y in runs)
        if total <= 0:
            return
        step = max(1, -(-total // self.writeback_pieces))
        pieces, lo, done = [], None, 0
        for x, y in runs:
            while x < y:
                e = min(y, x + step - done)
                st.d2h_copy_(self.dk_host[layer, x:e], self.dk_cache[base + x : base + e])
                st.d2h_copy_(self.dv_host[layer, x:e], self.dv_cache[base + x : base + e])
                self._stats["d2h_bytes"] += 2 * self.dk_host[layer, x:e].numel() * self.dk_host.element_size()
                lo = x if lo is None else lo
                done += e - x
                x = e
                if done == step:
                    pieces.append((lo, e, self._d2h_event()))
                    lo, done = None, 0
        if self._written is not None:
            written = self._written
            st.d2h_run(lambda: [written[layer, x:y].fill_(True) for x, y in runs])
        if lo is not None:
            pieces.append((lo, runs[-1][1], self._d2h_event()))
        else:
            pieces[-1] = (pieces[-1][0], pieces[-1][1], self._d2h_event())
        self._wb_prev[s] = self._wb_buf[s]
        self._wb_pieces[s] = pieces
        self._wb_buf[s] = pieces[-1][2]
        self._wb_layer[layer] = pieces[-1][2]

    def _writeback_split(self, s: int, x: int, y: int) -> list[tuple[int, int, int]]:
        """Slots [x, y) of set ``s`` cut at the last write-back's piece bounds -> ``(x, y, piece)``, ``piece`` the
        index of the last piece whose slot range overlaps the part (-1: none)."""
        out = []
        pieces = self._wb_pieces[s]
        i = 0
        while x < y:
            while i < len(pieces) and pieces[i][1] <= x:
                i += 1
            if i == len(pieces):
                out.append((x, y, -1))
                break
            lo, hi, _ = pieces[i]
            if x < lo:  # a gap before piece i
                e = min(y, lo)
                out.append((x, e, -1))
                x = e
                continue
            e = min(y, hi)
            out.append((x, e, i))
            x = e
        return out

    def _after_writeback_piece(self, s: int, piece: int) -> None:
        """The host->device stream waits until write-back piece ``piece`` out of set ``s`` has read its slots."""
        if piece >= 0:
            self._streams.copy_wait(self._wb_pieces[s][piece][2])

    def _after_host_writes(self, layer: int) -> None:
        """The host->device stream waits until the host pages of ``layer`` hold what was written to them."""
        if self._wb_layer[layer] is not None:
            self._streams.copy_wait(self._wb_layer[layer])

    def _after_writeback_out_of(self, buf: int) -> None:
        """The host->device stream waits until the last write-back out of set / buffer ``buf`` has read it."""
        if self._wb_buf[buf] is not None:
            self._streams.copy_wait(self._wb_buf[buf])

    # --------------------------------------------------------------- staging
    def _set(self, layer: int) -> int:
        return layer % self.staging_sets

    def _satisfied(self, use: _Use) -> tuple[bool, bool]:
        """(K/V present, dK/dV present) for ``use`` in its staging set (trivially so when all resident)."""
        R = self.resident_pages_per_layer
        tag = self._tag[self._set(use.layer)]
        kv_here = (tag is not None and tag.layer == use.layer and tag.past == use.past and tag.kv
                   and _covers(tag.pages, use.pages))
        kv_ok = use.past <= R or kv_here or use.pages == ()  # (): a Stage-1 past all resident or in the shadow
        grad_ok = (
            not use.grad
            or use.past + use.own <= R
            or (kv_here and tag.grad_start == use.start and tag.grad_own == use.own
                and _covers(tag.grad_pages, use.pages))
        )
        return kv_ok, grad_ok

    def _stage(self, use: _Use, why: str) -> None:
        """Copy what ``use`` lacks into staging set ``layer % K`` (side stream)."""
        kv_ok, grad_ok = self._satisfied(use)
        if kv_ok and grad_ok:
            return
        s = self._set(use.layer)
        if self._busy[s] and self._owner[s] != use.layer:
            raise RuntimeError(
                f"staging set {s} is in use by layer {self._owner[s]} while layer {use.layer} needs it: "
                "attention_view/after_attention_forward/after_backward were called out of the engine's order"
            )
        R, W, L = self.resident_pages_per_layer, self.staging_pages, self.num_layers
        base = L * R + s * W
        layer = use.layer
        tag = self._tag[s]
        # Readers of the set are done at _free[s]; a set still held by this same layer (an upgrade
        # to K/V + dK/dV) waits for everything enqueued so far instead.
        st = self._streams
        st.copy_wait(st.record_compute() if self._busy[s] else self._free[s])
        self._after_host_writes(layer)
        if isinstance(use.pages, _HeadsOf):
            self._stage_heads(use, s, base, kv_ok, grad_ok)
            tag = self._tag[s] if kv_ok else _Tag(layer, use.past, kv=True, pages=use.pages)
            if not grad_ok:
                tag.grad_start, tag.grad_own, tag.grad_pages = use.start, use.own, use.pages
            kv_ok = grad_ok = True
        if not kv_ok:
            # Pages keep their slots (base + p - R) either way: only the copies differ.
            for a, e in ((R, use.past),) if use.pages is None else use.pages:
                st.copy_(self.k_cache[base + a - R : base + e - R], self.k_host[layer, a - R : e - R])
                st.copy_(self.v_cache[base + a - R : base + e - R], self.v_host[layer, a - R : e - R])
                self._stats["h2d_bytes"] += 2 * self.k_host[layer, a - R : e - R].numel() * self.k_host.element_size()
            tag = _Tag(layer, use.past, kv=True, pages=use.pages)
        if not grad_ok:
            # dK/dV of the past pages read (all, or the needed runs) and of the chunk's own pages beyond R.
            # Only these slots are read by a write-back out of the set: the K/V copies above may run
            # while the previous layer's write-back is still in flight; each dK/dV copy below waits
            # for the write-back piece(s) out of its slots.
            if self._wb_prev[s] is not None:
                st.copy_wait(self._wb_prev[s])
            end = use.past + use.own
            if use.pages is None:
                spans = [(R, end)]
            else:
                spans = list(use.pages)
                own_lo = max(use.past, R)
                if end > own_lo:
                    if spans and spans[-1][1] == own_lo:
                        spans[-1] = (spans[-1][0], end)
                    else:
                        spans.append((own_lo, end))
            heads_used = self._heads_used[layer]
            for a, e in spans:
                # After a head-grained write-back into this layer, page-level validity no longer tells which
                # tiles hold a gradient: copy the span, then zero the never-written tiles (below).
                for x0, y0, ok in ((a, e, True),) if heads_used else self._valid_runs(layer, a, e):
                    for x, y, piece in self._writeback_split(s, x0 - R, y0 - R):  # slot offsets
                        self._after_writeback_piece(s, piece)
                        if ok:
                            st.copy_(self.dk_cache[base + x : base + y], self.dk_host[layer, x:y])
                            st.copy_(self.dv_cache[base + x : base + y], self.dv_host[layer, x:y])
                            self._stats["h2d_bytes"] += 2 * self.dk_host[layer, x:y].numel() * self.dk_host.element_size()
                        else:  # never written back: zero on the device instead of copying
                            st.zero_(self.dk_cache[base + x : base + y])
                            st.zero_(self.dv_cache[base + x : base + y])
                if heads_used:
                    self._zero_unwritten(layer, base, a - R, e - R)
            if tag is None or tag.layer != layer or tag.past != use.past:
                tag = _Tag(layer, use.past, kv=use.past <= R or use.pages == (), pages=use.pages)
            tag.grad_start, tag.grad_own, tag.grad_pages = use.start, use.own, use.pages
        st.record_copy(self._ready[s])
        self._tag[s] = tag
        self._stats[why] += 1
        if self.trace is not None:
            self.trace.append(("stage", why, layer, use.start, use.past, use.own if use.grad else None))

    def _zero_unwritten(self, layer: int, base: int, x: int, y: int) -> None:
        """Zero the staged dK/dV tiles of host pages [x, y) (offsets from R; slots base + x..) never written back."""
        dk, dv, written = self.dk_cache, self.dv_cache, self._written

        def run():
            keep = written[layer, x:y][:, None, :, None]  # [n, 1, Hkv, 1]
            zero = torch.zeros((), dtype=dk.dtype, device=dk.device)
            dk[base + x : base + y] = torch.where(keep, dk[base + x : base + y], zero)
            dv[base + x : base + y] = torch.where(keep, dv[base + x : base + y], zero)

        self._streams.h2d_run(run)

    # ------------------------------------------------------------ head-grained stagings
    def _head_tiles(self, use: _Use) -> tuple:
        """(pairs, count_all, count_kv, mask, made) of a head-grained use, made on the host->device stream once
        per (layer, chunk): ``mask`` [past + own - R, Hkv] bool marks the host tiles the selection reads (all
        heads of the own pages), ``pairs[:count_all]`` lists them (:func:`~oomb.ops.page_gather.head_pairs`),
        the first ``count_kv`` being past pages'; ``made``: an event on that stream after they are written."""
        key = (use.layer, use.start, use.pages.own)
        hit = self._pairs_cache.get(key)
        if hit is not None:
            return hit
        R, Hkv = self.resident_pages_per_layer, self.num_kv_heads
        past, own = use.past, use.pages.own
        page_idx = self.needed_heads(use.layer, use.start)
        n = past + own - R
        dev = self.device
        t: dict = {}
        # Allocated on the host->device stream (its kernels fill them; the device->host stream reads them).
        self._streams.h2d_alloc(lambda: t.update(
            full=torch.empty((past + own, Hkv), dtype=torch.bool, device=dev),
            pairs=torch.empty(n * Hkv + 1, dtype=torch.int32, device=dev),
            count_all=torch.empty(1, dtype=torch.int32, device=dev),
            count_kv=torch.empty(1, dtype=torch.int32, device=dev),
        ))
        full, pairs, count_all, count_kv = t["full"], t["pairs"], t["count_all"], t["count_kv"]
        st = self._streams
        if self._seq_len is not None and use.start + self.chunk_size >= self._seq_len:
            # The last chunk's selection is made in Stage 2, just before this (compute stream): read it after.
            st.copy_wait(st.record_compute())

        st.h2d_keep(page_idx)  # made on the compute stream, read below on the copy stream

        def run():
            full.zero_()
            idx = page_idx.clamp(min=0).long()  # padding reads page 0 (the reference gathers it, then masks it)
            heads = torch.arange(Hkv, device=dev)[None, :, None].expand_as(idx)
            full[idx, heads] = True
            full[past:] = True
            head_pairs(full[R:], out=(pairs, count_all))
            count_kv.copy_(full[R:past].sum(dtype=torch.int32).reshape(1))

        st.h2d_run(run)
        # The list is made on the host->device stream; a write-back (device->host stream) that is the first to
        # need it (its staging found the tiles already there, e.g. in a whole-layer staging) waits for this.
        made = st.event()
        st.record_copy(made)
        hit = self._pairs_cache[key] = (pairs, count_all, count_kv, full[R:], made)
        return hit

    def _stage_heads(self, use: _Use, s: int, base: int, kv_ok: bool, grad_ok: bool) -> None:
        """Stage the tiles of a head-grained use (K/V of its past tiles; dK/dV of those and of its own pages)."""
        st = self._streams
        layer, m = use.layer, use.past - self.resident_pages_per_layer
        o = use.pages.own
        pairs, count_all, count_kv, _, _ = self._head_tiles(use)
        tile = self.page_size * self.head_dim
        kc, vc, kh, vh = self.k_cache, self.v_cache, self.k_host[layer], self.v_host[layer]
        dkc, dvc, dkh, dvh = self.dk_cache, self.dv_cache, self.dk_host[layer], self.dv_host[layer]
        counter, nprog = self._dev_bytes, self.gather_programs
        if not kv_ok:
            # The K/V stash: a Stage-2 forward use of a layer below L - K keeps its first C tiles, which that
            # layer's backward use of the same chunk takes back instead of reading them over PCIe. Both lists
            # begin with the same past tiles (ascending; the backward's own-page tiles come after them).
            C = self.kv_stash_tiles if layer < self.num_layers - self.staging_sets else 0
            key = use.start
            restore = C and use.grad and self._stash_key[layer] == key
            keep = C and not use.grad
            sk = self._stash_k[layer] if C else None
            sv = self._stash_v[layer] if C else None
            tile_bytes = 2 * tile * kh.element_size()

            def kv():
                first = 0
                if restore:
                    unstash_head_tiles(kc, base, m, sk, pairs, count_kv, nprog)
                    unstash_head_tiles(vc, base, m, sv, pairs, count_kv, nprog)
                    first = C
                    counter[2] += count_kv[0].long().clamp(max=C) * tile_bytes
                gather_head_pages(kc, base, kh[:m], pairs, count_kv, num_programs=nprog, first=first)
                gather_head_pages(vc, base, vh[:m], pairs, count_kv, num_programs=nprog, first=first)
                counter[0] += (count_kv[0].long() - first).clamp(min=0) * tile_bytes
                if keep:
                    stash_head_tiles(sk, kc, base, m, pairs, count_kv, nprog)
                    stash_head_tiles(sv, vc, base, m, pairs, count_kv, nprog)

            st.h2d_run(kv)
            if C:
                self._stash_key[layer] = key if keep else None
        if not grad_ok:
            if self._wb_prev[s] is not None:
                st.copy_wait(self._wb_prev[s])
            valid = self._written[layer, : m + o]
            # The dK/dV slots are read by the last write-back out of this set, in pieces (slot ranges with an
            # event each): pages outside every piece (gaps, the tail) are gathered first, with no wait, then each
            # piece's after its event, so this staging follows the write-back instead of waiting for all of it.
            free, waits, x = [], [], 0
            for lo, hi, ev in self._wb_pieces[s]:
                if lo > x:
                    free.append((x, lo, None))
                waits.append((lo, hi, ev))
                x = max(x, hi)
            free.append((x, m + o, None))
            for lo, hi, ev in free + waits:
                if hi <= lo or lo >= m + o:
                    continue
                if ev is not None:
                    st.copy_wait(ev)

                def grad(lo=lo, hi=hi):
                    gather_head_pages(dkc, base, dkh[: m + o], pairs, count_all, valid, nprog, pages=(lo, hi))
                    gather_head_pages(dvc, base, dvh[: m + o], pairs, count_all, valid, nprog, pages=(lo, hi))

                st.h2d_run(grad)
            st.h2d_run(lambda: counter.__setitem__(0, counter[0] + count_all[0].long() * (2 * tile * dkh.element_size())))

    def _write_back_heads(self, use: _Use, s: int, base: int) -> None:
        """D2H of the past dK/dV tiles a head-grained backward wrote; marks them written (device mask)."""
        st = self._streams
        layer, m = use.layer, use.past - self.resident_pages_per_layer
        pairs, _, count_kv, mask, made = self._head_tiles(use)
        st.d2h_wait(made)
        tile = self.page_size * self.head_dim
        dkc, dvc, dkh, dvh = self.dk_cache, self.dv_cache, self.dk_host[layer], self.dv_host[layer]
        written, counter, nprog = self._written, self._dev_bytes, self.gather_programs

        # In pieces of pages with an event each (as whole-layer write-backs): the next staging into this set
        # (two layers down) gathers each piece's slots as soon as that piece is out.
        step = max(1, -(-m // self.writeback_pieces))
        pieces = []
        for lo in range(0, m, step):
            hi = min(m, lo + step)

            def run(lo=lo, hi=hi):
                scatter_head_pages(dkh[:m], dkc, base, pairs, count_kv, nprog, pages=(lo, hi))
                scatter_head_pages(dvh[:m], dvc, base, pairs, count_kv, nprog, pages=(lo, hi))

            st.d2h_run(run, pairs, count_kv)
            pieces.append((lo, hi, self._d2h_event()))

        def mark():
            written[layer, :m] |= mask[:m]
            counter[1] += count_kv[0].long() * (2 * tile * dkh.element_size())

        st.d2h_run(mark, mask, count_kv)
        self._heads_used[layer] = True
        ev = self._d2h_event()
        pieces[-1] = (pieces[-1][0], pieces[-1][1], ev)
        self._wb_prev[s] = self._wb_buf[s]
        self._wb_pieces[s] = pieces
        self._wb_buf[s] = ev
        self._wb_layer[layer] = ev
        for key in [key for key in self._pairs_cache if key[:2] == (layer, use.start)]:
            del self._pairs_cache[key]

    def _valid_runs(self, layer: int, a: int, e: int) -> list[tuple[int, int, bool]]:
        """Pages [a, e) (>= R) of ``layer`` split into runs ``(x, y, written)``: whether their host dK/dV
        hold a written-back gradient (else the staging zero-fills them)."""
        gv = max(self._grad_valid[layer], a)
        out: list[tuple[int, int, bool]] = []
        if gv > a:
            out.append((a, min(gv, e), True))
        extra = self._grad_extra[layer]
        if not extra:
            if e > gv:
                out.append((gv, e, False))
            return out
        for p in range(gv, e):
            ok = p in extra
            if out and out[-1][2] == ok and out[-1][1] == p:
                out[-1] = (out[-1][0], p + 1, ok)
            else:
                out.append((p, p + 1, ok))
        return out

    def _mark_written(self, layer: int, runs) -> None:
        """Host dK/dV of the pages of ``runs`` ([a, e), >= R) now hold a written-back gradient."""
        R = self.resident_pages_per_layer
        gv = max(self._grad_valid[layer], R)
        extra = self._grad_extra[layer]
        for a, e in runs:
            if e <= gv:
                continue
            if a <= gv:
                gv = e
            else:
                extra.update(range(a, e))
        while gv in extra:
            extra.discard(gv)
            gv += 1
        if extra:
            extra.difference_update([p for p in extra if p < gv])
        if gv > max(self._grad_valid[layer], R):
            self._grad_valid[layer] = gv

    def _stage2_use(self, layer: int, start: int, past: int, own: int, grad: bool) -> _Use:
        """A Stage-2 use; its ``pages`` are the selection's tiles (:class:`_HeadsOf`, head grain with a
        ``needed_heads`` hook that knows them), else the host pages the ``needed_pages`` hook names (None: all)."""
        if (self.stage_grain == "head" and self.needed_heads is not None and past > self.resident_pages_per_layer
                and self.needed_heads(layer, start) is not None):
            return _Use(layer, start, past, own, grad, _HeadsOf(start, own))
        return _Use(layer, start, past, own, grad, self._needed_runs(layer, start, past))

    def _needed_runs(self, layer: int, start: int, past: int) -> tuple[tuple[int, int], ...] | None:
        """Runs of the host pages [R, past) the attention of (``layer``, chunk at ``start``) reads (None: all)."""
        R = self.resident_pages_per_layer
        if self.needed_pages is None or past <= R:
            return None
        key = (layer, start)
        if key not in self._runs_cache:
            pages = self.needed_pages(layer, start)
            if pages is not None:
                runs = _page_runs(pages[bisect.bisect_left(pages, R) : bisect.bisect_left(pages, past)])
                pages = _coalesce_runs(runs, R, past, self.stage_merge_gap_pages, self.stage_whole_fraction,
                                       self.stage_max_runs)
            self._runs_cache[key] = pages
        return self._runs_cache[key]

    def _wait_staged(self, use: _Use, ev) -> None:
        # The compute stream waits for the copies into a staging set (a test removes it to show the simulator notices).
        self._streams.compute_wait(ev)

    def _acquire(self, use: _Use) -> None:
        """Make ``use``'s pages ready for the compute stream (staging now what was not prefetched)."""
        if self._pending == use:
            self._pending = None
        self._stage(use, "on_demand")
        s = self._set(use.layer)
        self._wait_staged(use, self._ready[s])
        self._busy[s] = True
        self._owner[s] = use.layer
        self._inflight[use.layer] = use

    def _release(self, layer: int, ev) -> None:
        s = self._set(layer)
        self._free[s] = ev
        self._busy[s] = False
        self._inflight.pop(layer, None)
        if self._pending is not None and not self._busy[self._set(self._pending.layer)]:
            use, self._pending = self._pending, None
            self._stage(use, "prefetched")

    def _prefetch(self, use: _Use | None) -> None:
        if use is None:
            return
        if self._busy[self._set(use.layer)]:
            self._pending = use  # staged as soon as that set's current use ends
        else:
            self._stage(use, "prefetched")

    def _next_chunk_forward(self, start: int, stage2: bool) -> _Use | None:
        """Layer 0's K/V use of the chunk at token ``start`` (None past the sequence)."""
        if start < 0 or (self._seq_len is not None and start >= self._seq_len):
            return None
        if stage2:
            return self._stage2_use(0, start, start // self.page_size, 0, False)
        if self._seq_len is not None and start + self.chunk_size >= self._seq_len:
            return _Use(0, start, start // self.page_size, 0, False)  # the last chunk: its first use is Stage 2's
        return self._stage1_use(0, start, start // self.page_size)

    def _stage1_use(self, layer: int, start: int, past: int) -> _Use:
        """A Stage-1 (K/V only) use: with the shadow, only the host pages beyond it ([R + Sh, past); () if none)."""
        Sh = self.stage1_shadow_pages
        if not Sh or self._in_stage2:
            return _Use(layer, start, past, 0, False)
        lo = self.resident_pages_per_layer + Sh
        return _Use(layer, start, past, 0, False, ((lo, past),) if past > lo else ())

    def _begin_stage2(self) -> None:
        """The step's first Stage-2 view: with the shadow, every dK/dV page is zeroed now (Stage 1 used their
        bytes for K/V; this also clears the resident pages' gradients, which Stage-1 writes then leave alone)."""
        self._in_stage2 = True
        if self.stage1_shadow_pages:
            self.dk_cache.zero_()
            self.dv_cache.zero_()
            self._streams.copy_wait(self._streams.record_compute())  # before any staging into dK/dV slots

    def _next_backward(self, use: _Use) -> _Use | None:
        """The use after the backward of ``use.layer``: the next lower layer's backward, or chunk c-1's forward."""
        if use.layer > 0:
            return self._stage2_use(use.layer - 1, use.start, use.past, use.own, True)
        return self._next_chunk_forward(use.start - self.chunk_size, True) if use.start > 0 else None

    # ------------------------------------------------------ engine interface
    def attention_view(
        self, layer: int, stage: int, start: int, length: int, is_last: bool, q_doc_start: torch.Tensor | None = None
    ) -> PagedKV:
        """The paged state of (chunk at token ``start``, ``layer``), its pages staged on the GPU.

        Same contract as :meth:`PagedKVStore.attention_view`. With segmented staging the view stages
        nothing itself: its ``segments`` (:class:`~oomb.ops.paged_attention.PastSegments`) stage each
        segment when the attention acquires it and write its dK/dV back when its backward releases
        it; ``after_backward`` frees the own-gradient buffer. With whole-layer staging the view
        stages the layer's past, and in Stage 2 its ``after_backward`` writes the updated past
        dK/dV back to the host and readies the next layer.
        """
        S, L = self.page_size, self.num_layers
        past = start // S
        if self.trace is not None:
            self.trace.append(("view", stage, layer, start))
        if self.segmented:
            own = 0 if (stage == 1 or is_last) else -(-length // S)
            seg = _SegmentedPast(self, layer, start, own)
            after = functools.partial(self._sched.end_backward, layer, start) if stage == 2 else None
            return PagedKV(None, None, None, start, q_doc_start=q_doc_start, after_backward=after, segments=seg)
        table = self.block_table[layer]
        if stage == 1:
            use = self._stage1_use(layer, start, past)
            self._acquire(use)
            nxt = self._stage1_use(layer + 1, start, past) if layer + 1 < L else self._next_chunk_forward(start + length, False)
            self._prefetch(nxt)
            if self.stage1_shadow_pages and not self._in_stage2:
                return PagedKV(self._k1, self._v1, self._table1[layer, :past], start, q_doc_start=q_doc_start)
            return PagedKV(self.k_cache, self.v_cache, table[:past], start, q_doc_start=q_doc_start)
        if not self._in_stage2:
            self._begin_stage2()
        if self._seen_start != start:
            self._seen_start, self._seen_layers = start, set()
        recompute = layer in self._seen_layers  # per-layer checkpointing re-runs the forward in backward
        self._seen_layers.add(layer)
        own = 0 if is_last else -(-length // S)
        bwd = self._stage2_use(layer, start, past, own, True)  # what this view's backward reads
        grad = recompute or layer == L - 1  # the backward of this view comes next
        use = bwd if grad else _Use(layer, start, past, 0, False, bwd.pages)
        self._acquire(use)
        if grad:
            nxt = self._next_backward(bwd)
        elif layer + 1 == L - 1:  # the top layer's forward is followed by its backward: stage its dK/dV too
            nxt = self._stage2_use(layer + 1, start, past, own, True)
        else:
            nxt = self._stage2_use(layer + 1, start, past, 0, False)
        self._prefetch(nxt)
        own_table = None if is_last else table[past : past + own]
        return PagedKV(
            self.k_cache, self.v_cache, table[:past], start, self.dk_cache, self.dv_cache, own_table, q_doc_start,
            after_backward=functools.partial(self._after_backward, bwd),
        )

    def layer_block_table(self, layer: int, num_pages: int) -> torch.Tensor:
        """int32 [num_pages] GPU slots of the first ``num_pages`` pages of ``layer`` (resident or staging; a view).

        Raises:
            RuntimeError: with segmented staging (a layer's pages have no fixed slots then).
        """
        if self.segmented:
            raise RuntimeError("a store with segmented staging has no fixed per-layer block table (segment_pages='layer' has)")
        return self.block_table[layer, :num_pages]

    def after_attention_forward(self, layer: int, stage: int) -> None:
        """The attention forward of ``layer`` is enqueued: a K/V-only staging set may be refilled."""
        if self.segmented:
            # Every segment was released by the attention itself. After an attention with no host
            # segment (chunk 0, or a resident past) the next host use is staged now; not at the view,
            # which comes before Stage 1 writes this layer's pages.
            self._sched._prefetch()
            return
        use = self._inflight.get(layer)
        if use is not None and not use.grad:
            self._release(layer, self._streams.record_compute())

    def _after_backward(self, use: _Use) -> None:
        """Write the layer's updated past dK/dV back to the host; ready the next layer's backward."""
        R, W, L = self.resident_pages_per_layer, self.staging_pages, self.num_layers
        s = self._set(use.layer)
        st = self._streams
        done = st.record_compute()  # the backward kernels of this layer are enqueued before this point
        m = use.past - R
        if m > 0 and use.pages is None:
            base = L * R + s * W
            st.d2h_wait(done)
            self._write_back_pieces(s, use.layer, base, [(0, m)])
            self._grad_valid[use.layer] = max(self._grad_valid[use.layer], use.past)
            if self._grad_extra[use.layer]:
                self._mark_written(use.layer, ())
            if self.trace is not None:
                self.trace.append(("writeback", use.layer, use.start, use.past))
        elif m > 0 and isinstance(use.pages, _HeadsOf):  # only the tiles the backward wrote
            st.d2h_wait(done)
            self._write_back_heads(use, s, L * R + s * W)
            if self.trace is not None:
                self.trace.append(("writeback", use.layer, use.start, use.past))
        elif m > 0 and use.pages:  # only the pages the backward wrote (the selected ones): the rest are untouched
            base = L * R + s * W
            st.d2h_wait(done)
            self._write_back_pieces(s, use.layer, base, [(a - R, e - R) for a, e in use.pages])
            self._mark_written(use.layer, use.pages)
            if self.trace is not None:
                self.trace.append(("writeback", use.layer, use.start, use.past))
        self._release(use.layer, done)
        nxt = self._next_backward(use)
        if nxt is not None and nxt.grad:
            self._acquire(nxt)  # its backward comes next: the compute stream waits for its pages here
            self._prefetch(self._next_backward(nxt))
        else:
            self._prefetch(nxt)

    # ------------------------------------------------------------------ tests
    def read_grad(self, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored dK/dV of tokens [start, start+n) of ``layer`` -> two [n, Hkv, D] tensors (synchronises)."""
        self._streams.synchronize()
        if self._cuda:
            torch.cuda.synchronize(self.device)
        S, R = self.page_size, self.resident_pages_per_layer
        out = []
        written = self._written.cpu() if self._written is not None else None
        for gpu, host in ((self.dk_cache, self.dk_host), (self.dv_cache, self.dv_host)):
            pages = []
            for p in range(start // S, -(-(start + n) // S)):
                if p < R:
                    pages.append(gpu[layer * R + p].cpu())
                elif written is not None:  # whole-layer staging tracks written tiles per (page, KV head)
                    keep = written[layer, p - R][None, :, None]
                    pages.append(torch.where(keep, host[layer, p - R], torch.zeros((), dtype=host.dtype)))
                elif self._host_grad_valid(layer, p):
                    pages.append(host[layer, p - R].clone())
                else:
                    pages.append(torch.zeros_like(host[layer, 0]))
            flat = torch.stack(pages).flatten(0, 1)
            off = start - (start // S) * S
            out.append(flat[off : off + n])
        return out[0], out[1]

    def _host_grad_valid(self, layer: int, page: int) -> bool:
        if self._sched is not None:
            return self._sched.page_valid(layer, page)
        return page < self._grad_valid[layer] or page in self._grad_extra[layer]

    def grad_written_pages(self, layer: int) -> int:
        """End of the pages [R, end) of ``layer`` whose host dK/dV hold a written-back gradient (0 if none)."""
        if self._sched is None:
            return self._grad_valid[layer]
        R = self.resident_pages_per_layer
        p = R
        while p < self.max_pages_per_layer and self._host_grad_valid(layer, p):
            p += 1
        return p if p > R else 0

    # ----------------------------------------------- segmented staging (hooks of _SegmentSchedule)
    def _slots(self, b: int) -> int:
        return self.num_layers * self.resident_pages_per_layer + b * self.staging_pages

    def stage(self, b: int, use: _SegUse, lo: int, hi: int, kv: bool, valid: int | None, why: str) -> None:
        """Copy host pages [lo, hi) of ``use.layer`` into buffer ``b`` (K/V if ``kv``; dK/dV if ``valid`` is
        not None: pages below ``valid`` copied, the rest zero-filled), on the side stream."""
        st, R = self._streams, self.resident_pages_per_layer
        base, m, h = self._slots(b), hi - lo, lo - R
        layer = use.layer
        st.copy_wait(self._free[b])  # kernels that read or wrote the buffer are enqueued before this point
        self._after_host_writes(layer)
        if kv:
            st.copy_(self.k_cache[base : base + m], self.k_host[layer, h : h + m])
            st.copy_(self.v_cache[base : base + m], self.v_host[layer, h : h + m])
            self._stats["h2d_bytes"] += 2 * m * self.k_host[0, 0].numel() * self.k_host.element_size()
        if valid is not None:
            self._after_writeback_out_of(b)
            nv = valid - lo
            if nv:
                st.copy_(self.dk_cache[base : base + nv], self.dk_host[layer, h : h + nv])
                st.copy_(self.dv_cache[base : base + nv], self.dv_host[layer, h : h + nv])
                self._stats["h2d_bytes"] += 2 * nv * self.dk_host[0, 0].numel() * self.dk_host.element_size()
            if m > nv:  # never written back: zero on the device instead of copying
                st.zero_(self.dk_cache[base + nv : base + m])
                st.zero_(self.dv_cache[base + nv : base + m])
        st.record_copy(self._ready[b])
        self._stats[why] += 1
        if self.trace is not None:
            self.trace.append(("stage", why, layer, use.start, use.seg, b, kv, valid is not None))

    def wait(self, b: int) -> None:
        """The compute stream waits for the copies into buffer ``b``."""
        self._wait_segment(self._ready[b])

    def _wait_segment(self, ev) -> None:
        # One place for every compute-side wait on a segment (a test removes it to show the simulator notices).
        self._streams.compute_wait(ev)

    def release(self, b: int, use: _SegUse, lo: int, hi: int, writeback: bool) -> None:
        """Readers of buffer ``b`` are enqueued; with ``writeback`` its dK/dV go back to the host (D2H)."""
        st, R = self._streams, self.resident_pages_per_layer
        ev = st.record_compute()
        self._free[b] = ev
        if writeback:
            base, m, h = self._slots(b), hi - lo, lo - R
            st.d2h_wait(ev)  # the backward kernels that added into the buffer
            st.d2h_copy_(self.dk_host[use.layer, h : h + m], self.dk_cache[base : base + m])
            st.d2h_copy_(self.dv_host[use.layer, h : h + m], self.dv_cache[base : base + m])
            self._wrote_back(b, use.layer)
            self._stats["d2h_bytes"] += 2 * m * self.dk_host[0, 0].numel() * self.dk_host.element_size()
            if self.trace is not None:
                self.trace.append(("writeback", use.layer, use.start, use.seg, b))

    def stage_own(self, ob: int, layer: int, lo: int, runs: list, why: str) -> None:
        """Copy the own-gradient host pages (runs of [a, e) pages from ``lo``, valid or zero) into own buffer ``ob``."""
        st, R, O = self._streams, self.resident_pages_per_layer, self.own_pages
        st.copy_wait(self._own_free[ob])
        self._after_host_writes(layer)
        for a, e, ok in runs:
            d0, d1 = ob * O + a - lo, ob * O + e - lo
            if ok:
                st.copy_(self.own_dk_cache[d0:d1], self.dk_host[layer, a - R : e - R])
                st.copy_(self.own_dv_cache[d0:d1], self.dv_host[layer, a - R : e - R])
                self._stats["h2d_bytes"] += 2 * (e - a) * self.dk_host[0, 0].numel() * self.dk_host.element_size()
            else:
                st.zero_(self.own_dk_cache[d0:d1])
                st.zero_(self.own_dv_cache[d0:d1])
        st.record_copy(self._own_ready[ob])
        self._stats[why] += 1
        if self.trace is not None:
            self.trace.append(("stage_own", why, layer, lo, ob))

    def wait_own(self, ob: int) -> None:
        self._wait_segment(self._own_ready[ob])

    def own_read(self, ob: int) -> None:
        self._own_free[ob] = self._streams.record_compute()

    def _segment(self, past: "_SegmentedPast", index: int, grad: bool) -> tuple:
        """(use, buffer, tensors) of segment ``index`` of ``past``, acquired."""
        use = _SegUse(past.layer, past.start, index, grad)
        b = self._sched.acquire(use)
        L, R, SP = self.num_layers, self.resident_pages_per_layer, self.segment_pages
        if b is None or index == 0:
            table = self._first_tables[0 if b is None else b, past.layer]
        else:
            off = self.max_pages_per_layer + self._slots(b) - (R + index * SP)
            table = self._ramp[off:]
        grads = (self.dk_cache, self.dv_cache) if grad else (None, None)
        return b, (self.k_cache, self.v_cache, table, *grads)

    def _own_grad(self, past: "_SegmentedPast", n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if past.own == 0:
            return None
        R, P, layer = self.resident_pages_per_layer, past.start // self.page_size, past.layer
        end = P + past.own
        out = []
        for gpu, own in ((self.dk_cache, self.own_dk_cache), (self.dv_cache, self.own_dv_cache)):
            parts = []
            if P < R:
                parts.append(gpu[layer * R + P : layer * R + min(R, end)])
            if end > R:
                ob = layer % 2
                parts.append(own[ob * self.own_pages : ob * self.own_pages + end - max(P, R)])
            pages = parts[0] if len(parts) == 1 else torch.cat(parts)
            out.append(pages.flatten(0, 1)[:n])
        return out[0], out[1]


class _SegmentedPast:
    """The :class:`~oomb.ops.paged_attention.PastSegments` of one (chunk, layer) view of an OffloadedKVStore."""

    def __init__(self, store: OffloadedKVStore, layer: int, start: int, own: int) -> None:
        self.store, self.layer, self.start, self.own = store, layer, start, own
        S = store.page_size
        self.bounds = [(lo * S, hi * S) for lo, hi in store._sched.page_bounds(start // S)]
        self._held: dict[tuple[int, bool], int | None] = {}

    def acquire(self, index: int, grad: bool) -> tuple:
        b, tensors = self.store._segment(self, index, grad)
        self._held[(index, grad)] = b
        return tensors

    def release(self, index: int, grad: bool) -> None:
        b = self._held.pop((index, grad))
        self.store._sched.release(_SegUse(self.layer, self.start, index, grad), b)

    def begin_backward(self) -> None:
        self.store._sched.begin_backward(self.layer, self.start, self.own)

    def own_grad(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.store._own_grad(self, n)
