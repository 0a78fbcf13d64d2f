"""Triton kernel of :mod:`oomb.ops.page_gather`: copy listed (page, KV head) tiles (imported lazily: Triton is optional).

On CUDA one of the two tensors is a page-locked host tensor, read or written directly over PCIe
(zero-copy). See :func:`oomb.ops.page_gather.gather_head_pages` for the contract.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["ELEMS_PER_LOAD", "launch_copy_tiles"]

ELEMS_PER_LOAD = 8192
"""Elements one program moves per load/store (rows of a tile at a time): 64 rows of head dim 128."""


@triton.jit
def _copy_tiles_kernel(
    dst_ptr, src_ptr, pairs_ptr, count_ptr, valid_ptr, n_max,
    dst_page0, src_page0, page_stride, row_stride, j_lo, j_hi,
    HKV: tl.constexpr, S: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_VALID: tl.constexpr, NPROG: tl.constexpr,
):
    # Tile (j, h): S rows of D elements at page (page0 + j), head h; rows are row_stride apart.
    pid = tl.program_id(0)
    n = tl.minimum(tl.load(count_ptr), n_max)  # never past the list
    rows = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    for i in range(pid, n, NPROG):
        pair = tl.load(pairs_ptr + i)
        j = pair // HKV
        h = pair % HKV
        src = src_ptr + (src_page0 + j).to(tl.int64) * page_stride + h * D
        dst = dst_ptr + (dst_page0 + j).to(tl.int64) * page_stride + h * D
        inside = (j >= j_lo) & (j < j_hi)  # tiles of other pages are another call's
        keep = inside
        if HAS_VALID:
            keep = keep & (tl.load(valid_ptr + pair, mask=inside, other=0) != 0)
        for s0 in range(0, S, BLOCK_S):
            r = s0 + rows
            m = (r < S)[:, None] & cmask[None, :] & inside
            off = r[:, None] * row_stride + cols[None, :]
            x = tl.load(src + off, mask=m & keep, other=0.0)
            tl.store(dst + off, x, mask=m)


def launch_copy_tiles(dst, src, dst_page0, src_page0, pairs, count, valid, num_programs, pages):
    """Copy the listed tiles of pages j in [lo, hi) (``pages``): ``dst[dst_page0 + j, :, h] =
    src[src_page0 + j, :, h]`` (zeros where ``valid[j, h]`` is False). Arguments checked by the caller."""
    S, Hkv, D = dst.shape[1:]
    j_lo, j_hi = pages
    block_d = triton.next_power_of_2(D)
    block_s = max(1, min(triton.next_power_of_2(S), ELEMS_PER_LOAD // block_d))
    _copy_tiles_kernel[(num_programs,)](
        dst, src, pairs, count, valid if valid is not None else pairs, pairs.numel(),
        dst_page0, src_page0, dst.stride(0), dst.stride(1), j_lo, j_hi,
        HKV=Hkv, S=S, D=D, BLOCK_S=block_s, BLOCK_D=block_d, HAS_VALID=valid is not None, NPROG=num_programs,
    )


