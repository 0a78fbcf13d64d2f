"""Triton kernel of :mod:`oomb.ops.page_gather`: copy listed (page, KV head) tiles (imported lazily: Triton is optional).

On CUDA one of the two tensors is a page-locked host tensor, read or written directly over PCIe
(zero-copy). See :func:`oomb.ops.page_gather.gather_head_pages` for the contract.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["ELEMS_PER_LOAD", "NUM_WARPS", "launch_copy_tiles"]

ELEMS_PER_LOAD = 16384
"""Elements one program moves per load/store (rows of a tile at a time; at most one tile): a whole 128-token tile
of head dim 128. The ``elems_per_load`` argument of :mod:`oomb.ops.page_gather`'s copies overrides it
(:attr:`oomb.config.KernelConfig.page_gather_elems`)."""

NUM_WARPS = 16
"""Warps per program. The ``num_warps`` argument of :mod:`oomb.ops.page_gather`'s copies overrides it
(:attr:`oomb.config.KernelConfig.page_gather_warps`): fewer programs with more warps each keep about as many loads
in flight while holding fewer SMs, which the compute beside the copies needs (docs/tuning.md)."""


@triton.jit
def _copy_tiles_kernel(
    dst_ptr, src_ptr, pairs_ptr, count_ptr, valid_ptr, n_max,
    dst_page0, src_page0, page_stride, row_stride, j_lo, j_hi, i_lo,
    HKV: tl.constexpr, S: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_VALID: tl.constexpr, NPROG: tl.constexpr, SRC_COMPACT: tl.constexpr, DST_COMPACT: tl.constexpr,
):
    # List entries i in [i_lo, min(count, n_max)). Tile (j, h): S rows of D elements at page (page0 + j), head h;
    # rows are row_stride apart. A compact side holds list entry i's tile at tile i ([*, S, D], rows D apart).
    pid = tl.program_id(0)
    n = tl.minimum(tl.load(count_ptr), n_max)  # never past the list
    rows = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    for i in range(i_lo + pid, n, NPROG):
        pair = tl.load(pairs_ptr + i)
        j = pair // HKV
        h = pair % HKV
        if SRC_COMPACT:
            src = src_ptr + tl.cast(i, tl.int64) * (S * D)
        else:
            src = src_ptr + (src_page0 + j).to(tl.int64) * page_stride + h * D
        if DST_COMPACT:
            dst = dst_ptr + tl.cast(i, tl.int64) * (S * D)
        else:
            dst = dst_ptr + (dst_page0 + j).to(tl.int64) * page_stride + h * D
        inside = (j >= j_lo) & (j < j_hi)  # tiles of other pages are another call's
        keep = inside
        if HAS_VALID:
            keep = keep & (tl.load(valid_ptr + pair, mask=inside, other=0) != 0)
        for s0 in range(0, S, BLOCK_S):
            r = s0 + rows
            m = (r < S)[:, None] & cmask[None, :] & inside
            src_off = r[:, None] * (D if SRC_COMPACT else row_stride) + cols[None, :]
            dst_off = r[:, None] * (D if DST_COMPACT else row_stride) + cols[None, :]
            x = tl.load(src + src_off, mask=m & keep, other=0.0)
            tl.store(dst + dst_off, x, mask=m)


def launch_copy_tiles(dst, src, dst_page0, src_page0, pairs, count, valid, num_programs, pages,
                      entries=(0, None), src_compact=False, dst_compact=False, num_warps=None, elems_per_load=None):
    """Copy the listed tiles of pages j in [lo, hi) (``pages``): ``dst[dst_page0 + j, :, h] =
    src[src_page0 + j, :, h]`` (zeros where ``valid[j, h]`` is False), for list entries i in ``entries``
    [i_lo, i_hi) (i_hi None: the whole list). A compact side (``*_compact``, ``[n, S, D]``) holds entry i's
    tile at ``[i]`` instead. ``num_warps`` / ``elems_per_load``: None for :data:`NUM_WARPS` /
    :data:`ELEMS_PER_LOAD`. Arguments checked by the caller."""
    paged = src if dst_compact else dst
    S, Hkv, D = paged.shape[1:]
    j_lo, j_hi = pages
    i_lo, i_hi = entries
    n_max = pairs.numel() if i_hi is None else min(i_hi, pairs.numel())
    block_d = triton.next_power_of_2(D)
    elems = ELEMS_PER_LOAD if elems_per_load is None else elems_per_load
    block_s = max(1, min(triton.next_power_of_2(S), elems // block_d))
    _copy_tiles_kernel[(num_programs,)](
        dst, src, pairs, count, valid if valid is not None else pairs, n_max,
        dst_page0, src_page0, paged.stride(0), paged.stride(1), j_lo, j_hi, i_lo,
        HKV=Hkv, S=S, D=D, BLOCK_S=block_s, BLOCK_D=block_d, HAS_VALID=valid is not None, NPROG=num_programs,
        SRC_COMPACT=src_compact, DST_COMPACT=dst_compact, num_warps=NUM_WARPS if num_warps is None else num_warps,
    )


