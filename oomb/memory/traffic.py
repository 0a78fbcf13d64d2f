"""Bytes one training step copies between the GPU pool and the pinned host tier (docs/design.md §2.3).

:func:`segment_traffic` runs the store's own :class:`~oomb.memory.schedule.SegmentSchedule` (or its closed form);
:func:`offload_traffic` adds the Stage-1 writes, and counts whole-layer staging in closed form.
"""

from __future__ import annotations

import torch

from .schedule import SegmentSchedule, SegUse
from .shape import ModelShape, dtype_size
from .tiering import stage1_shadow_pages as shadow_pages, staging_pages

__all__ = ["offload_traffic", "segment_traffic"]


class CountingHooks:
    """Hooks of :class:`SegmentSchedule` that only count bytes (the planner's view of a step)."""

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

    ``simulate`` True runs :class:`SegmentSchedule` over the step's predicted calls (exact by
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
    hooks = CountingHooks(kv_page_bytes, grad_page_bytes)
    sched = SegmentSchedule(hooks, num_layers, page_size, chunk_size, resident_pages_per_layer, segment_pages,
                             checkpoint_layers)
    sched.saved_attention = saved_attention
    sched.reset(seq_len)
    L, C, S = num_layers, chunk_size, page_size
    N = -(-seq_len // C)

    def fwd(layer, s):
        for i in range(len(sched.page_bounds(s // S))):
            u = SegUse(layer, s, i, False)
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
                u = SegUse(layer, s, i, True)
                sched.release(u, sched.acquire(u))
            sched.end_backward(layer, s)
        if c < N - 1:
            for layer in range(L):
                sched.release_from(layer, s // S)
    return hooks.h2d, hooks.d2h



def offload_traffic(
    shape: ModelShape, seq_len: int, chunk_size: int, page_size: int, resident_pages_per_layer: int,
    dtype: torch.dtype = torch.bfloat16, segment_pages: int | None = None, checkpoint_layers: bool = False,
    saved_attention: bool = False, stage1_shadow_pages: int | None = None, staging_sets: int | None = None,
    *, stage1_shadow: bool = True, stage1_shadow_partial: bool = True,
) -> dict[str, int]:
    """Bytes one training step copies host->device and device->host with offload (the schedule of
    :mod:`oomb.engine.offload`).

    With segmented staging (``segment_pages`` an int) the staging copies come from running the
    store's own schedule (:func:`segment_traffic`) over the step's calls (it
    depends on ``checkpoint_layers``: per-layer checkpointing whose rerun runs the attention forward again,
    ``checkpoint_attention='recompute'``), plus the Stage-1 writes of new pages beyond R. Roughly:
    every segment use stages its K/V (the backward reuses the last two segments the forward
    left in the buffers), every backward its dK/dV, and writes them back. ``saved_attention``
    (segmented only): the Stage-2 forwards of chunks 0..N-2 read no past (``save_attention``).

    Whole-layer staging (``segment_pages`` None; the same with or without per-layer checkpointing),
    per layer and chunk c (P = c*C/S past pages, n = C/S own pages, R resident):
    Stage 1 (c < N-1) stages K/V of pages [R + Sh, P) and writes back the new pages beyond R (Sh: the pages
    per layer Stage 1 keeps in the pool's dK/dV bytes, ``stage1_shadow_pages``; None = what a store with
    ``stage1_shadow`` and ``stage1_shadow_partial`` keeps, :func:`~oomb.memory.tiering.stage1_shadow_pages`);
    Stage 2 stages K/V [R, P) for the forward, again for the backward of layers 0..L-K-1 (their staging set
    was reused by layer l+K; K = ``staging_sets``, the store's
    :attr:`~oomb.engine.offload.OffloadedKVStore.staging_sets`, None = 2), dK/dV [R, P + n)
    (chunk N-1: zero-filled on the device, not copied), and writes back dK/dV [R, P).

    Returns:
        {"h2d_bytes": ..., "d2h_bytes": ...}.
    """
    L, S, C, R = shape.num_layers, page_size, chunk_size, resident_pages_per_layer
    e = dtype_size(dtype)
    kvb = S * shape.kv_dim * 2 * e
    gb = S * shape.kv_dim * 2 * (8 if dtype == torch.float64 else 4)
    N = -(-seq_len // C)
    n = C // S
    h2d = d2h = 0
    if segment_pages is not None:
        for c in range(N - 1):  # Stage-1 writes of the new pages beyond R
            P = c * n
            d2h += L * max(P + n - max(P, R), 0) * kvb
        h2d_s, d2h_s = segment_traffic(L, seq_len, C, S, R, segment_pages, checkpoint_layers, kvb, gb,
                                       saved_attention=saved_attention)
        return {"h2d_bytes": h2d_s, "d2h_bytes": d2h + d2h_s}
    K = 2 if staging_sets is None else staging_sets
    if stage1_shadow_pages is None and not stage1_shadow:
        stage1_shadow_pages = 0  # as the store: the shadow turned off
    if stage1_shadow_pages is None:
        npl = -(-seq_len // S)
        stage1_shadow_pages = shadow_pages(L, npl, R, L * R + K * staging_pages(npl, R, None), dtype,
                                           torch.float64 if dtype == torch.float64 else torch.float32,
                                           stage1_shadow_partial)
    for c in range(N):
        P = c * n
        kv = max(P - R, 0)
        if c < N - 1:  # Stage 1
            h2d += L * max(P - R - stage1_shadow_pages, 0) * kvb
            d2h += L * max(P + n - max(P, R), 0) * kvb
        own = n if c < N - 1 else 0
        h2d += L * kv * kvb + max(L - K, 0) * kv * kvb  # Stage-2 forward; backward of layers 0..L-K-1
        if c < N - 1:
            h2d += L * max(P + own - R, 0) * gb
        d2h += L * kv * gb
    return {"h2d_bytes": h2d, "d2h_bytes": d2h}
