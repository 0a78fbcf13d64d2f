"""Copy chosen (page, KV head) tiles between the host tier and the GPU pool, without a host sync.

Sparse attention reads, per (query block, KV head), a few past pages. Staging whole pages moves
all KV heads of a page even when one head selected it; staging whole layers moves every page.
These routines move only the ``(page, head)`` tiles named by a boolean mask ``[m, Hkv]`` made on
the device, so the host never waits for a selection:

* :func:`head_pairs` compacts the mask into a list of flat indices ``j * Hkv + h`` plus its
  length, both on the device (cumsum + scatter; no ``nonzero``, which syncs).
* :func:`gather_head_pages` copies tile ``(j, h)`` of ``src`` (``[m, S, Hkv, D]``, e.g. a layer of
  the pinned host tier) into page ``base + j`` of ``dst`` (the GPU pool ``[P, S, Hkv, D]``), or
  writes zeros there where ``valid[j, h]`` is False (a host gradient tile never written back).
* :func:`scatter_head_pages` copies tile ``(j, h)`` of page ``base + j`` of the pool back to
  ``dst[j]``.

On CUDA with a host ``src``/``dst`` these are Triton kernels that read or write page-locked host
memory directly over PCIe (zero-copy: under unified virtual addressing a pinned host tensor's
address is valid on the device), with a small persistent grid (``num_programs``) so that the copy
leaves most SMs to the compute running beside it. One tile is ``S`` rows of ``D`` contiguous
elements, ``Hkv * D`` elements apart. Elsewhere (CPU tensors, the CPU tests) the same copies are
PyTorch index operations (:func:`gather_head_pages_ref`, :func:`scatter_head_pages_ref`), and the
kernels run under the Triton interpreter in the tests.

Shape legend: m pages of the source span, S page_size (tokens), Hkv KV heads, D head dim, P pool
pages. Units: pages and tokens; ``count`` is in tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "head_pairs",
    "gather_head_pages",
    "gather_head_pages_ref",
    "scatter_head_pages",
    "scatter_head_pages_ref",
]

DEFAULT_PROGRAMS = 32
"""Persistent programs of a copy kernel (of 132 SMs on an H200): enough requests in flight to fill PCIe."""


def head_pairs(
    mask: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact a [m, Hkv] bool mask on its device, without a host sync.

    Args:
        mask: bool [m, Hkv].
        out: optional (pairs, count) tensors to fill (shapes and dtypes as returned).

    Returns:
        pairs: int32 [m * Hkv + 1]; ``pairs[:count]`` are the flat indices ``j * Hkv + h`` of the
            True entries, ascending; the rest is unspecified.
        count: int32 [1], the number of True entries.
    """
    flat = mask.reshape(-1)
    n = flat.numel()
    if out is None:
        pairs = torch.empty(n + 1, dtype=torch.int32, device=mask.device)
        count = torch.empty(1, dtype=torch.int32, device=mask.device)
    else:
        pairs, count = out
        if pairs.shape != (n + 1,) or count.shape != (1,) or pairs.dtype != torch.int32 or count.dtype != torch.int32:
            raise ValueError(f"head_pairs: out must be int32 [{n + 1}] and [1]; got {tuple(pairs.shape)}, {tuple(count.shape)}")
    if n == 0:
        count.zero_()
        return pairs, count
    csum = torch.cumsum(flat, 0, dtype=torch.int32)
    count.copy_(csum[-1:])
    dest = torch.where(flat, csum - 1, n).long()
    pairs.scatter_(0, dest, torch.arange(n, dtype=torch.int32, device=mask.device))
    return pairs, count


def _check(pool: torch.Tensor, span: torch.Tensor, base: int, what: str) -> None:
    if pool.dim() != 4 or span.dim() != 4 or pool.shape[1:] != span.shape[1:]:
        raise ValueError(f"{what}: pool {tuple(pool.shape)} and span {tuple(span.shape)} must be [*, S, Hkv, D] alike")
    if pool.dtype != span.dtype:
        raise ValueError(f"{what}: pool dtype {pool.dtype} != span dtype {span.dtype}")
    if not (pool.is_contiguous() and span.stride() == pool.stride()):
        raise ValueError(f"{what}: pool must be contiguous and the span's pages laid out like the pool's")
    if base < 0 or base + span.shape[0] > pool.shape[0]:
        raise ValueError(f"{what}: pages [{base}, {base + span.shape[0]}) are outside the pool's {pool.shape[0]}")


def _tiles(pairs: torch.Tensor, count: torch.Tensor, Hkv: int, pages) -> tuple[torch.Tensor, torch.Tensor]:
    """(page j, head h) long index vectors of the listed tiles with j in ``pages`` [lo, hi) (None: all; syncs:
    reference path only)."""
    idx = pairs[: int(count.item())].long()
    j, h = idx // Hkv, idx % Hkv
    if pages is not None:
        keep = (j >= pages[0]) & (j < pages[1])
        j, h = j[keep], h[keep]
    return j, h


def gather_head_pages_ref(dst, base, src, pairs, count, valid=None, pages=None) -> None:
    """PyTorch reference of :func:`gather_head_pages` (same arguments; syncs on ``count``)."""
    j, h = _tiles(pairs, count, src.shape[2], pages)
    if j.numel() == 0:
        return
    jd, hd = j.to(dst.device), h.to(dst.device)
    tiles = src[j.to(src.device), :, h.to(src.device)].to(dst.device)  # [n, S, D]
    if valid is not None:
        keep = valid.reshape(-1)[(j * src.shape[2] + h).to(valid.device)].to(dst.device)
        tiles = torch.where(keep[:, None, None], tiles, torch.zeros((), dtype=tiles.dtype, device=dst.device))
    dst[base + jd, :, hd] = tiles


def scatter_head_pages_ref(dst, src, base, pairs, count, pages=None) -> None:
    """PyTorch reference of :func:`scatter_head_pages` (same arguments; syncs on ``count``)."""
    j, h = _tiles(pairs, count, dst.shape[2], pages)
    if j.numel() == 0:
        return
    tiles = src[(base + j).to(src.device), :, h.to(src.device)].to(dst.device)
    dst[j.to(dst.device), :, h.to(dst.device)] = tiles


@triton.jit
def _copy_tiles_kernel(
    dst_ptr, src_ptr, pairs_ptr, count_ptr, valid_ptr,
    dst_page0, src_page0, page_stride, row_stride, j_lo, j_hi,
    HKV: tl.constexpr, S: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_VALID: tl.constexpr, NPROG: tl.constexpr,
):
    # Tile (j, h): S rows of D elements at page (page0 + j), head h; rows are row_stride apart.
    pid = tl.program_id(0)
    n = tl.load(count_ptr)
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


def _launch(dst, src, dst_page0, src_page0, pairs, count, valid, num_programs, pages):
    S, Hkv, D = dst.shape[1:]
    j_lo, j_hi = (0, 2**31 - 1) if pages is None else pages
    block_d = triton.next_power_of_2(D)
    block_s = max(1, min(triton.next_power_of_2(S), 8192 // block_d))
    _copy_tiles_kernel[(num_programs,)](
        dst, src, pairs, count, valid if valid is not None else pairs,
        dst_page0, src_page0, dst.stride(0), dst.stride(1), j_lo, j_hi,
        HKV=Hkv, S=S, D=D, BLOCK_S=block_s, BLOCK_D=block_d, HAS_VALID=valid is not None, NPROG=num_programs,
    )


def _use_kernel(pool: torch.Tensor, span: torch.Tensor, backend: str) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch'; got {backend!r}")
    if backend != "auto":
        return backend == "triton"
    return pool.device.type == "cuda" and (span.device.type == "cuda" or span.is_pinned())


def gather_head_pages(
    dst: torch.Tensor,
    base: int,
    src: torch.Tensor,
    pairs: torch.Tensor,
    count: torch.Tensor,
    valid: torch.Tensor | None = None,
    num_programs: int = DEFAULT_PROGRAMS,
    backend: str = "auto",
    pages: tuple[int, int] | None = None,
) -> None:
    """``dst[base + j, :, h] = src[j, :, h]`` for each listed tile (zeros where ``valid[j, h]`` is False).

    Args:
        dst: [P, S, Hkv, D] contiguous (the GPU pool).
        base: pool page of ``src``'s page 0.
        src: [m, S, Hkv, D] with the pool's page layout (a layer's host span; pinned on CUDA).
        pairs, count: from :func:`head_pairs` over an [m, Hkv] mask, on ``dst``'s device.
        valid: optional bool [m, Hkv] on ``dst``'s device: False tiles are zero-filled, not read.
        num_programs: persistent programs of the CUDA kernel.
        backend: ``'auto'`` (the kernel for a CUDA pool and a CUDA or pinned span, else PyTorch),
            ``'triton'`` (the kernel; on CPU only under ``TRITON_INTERPRET=1``) or ``'torch'``.
        pages: optional [lo, hi): only the listed tiles of pages lo <= j < hi (a piece of a larger copy that
            waits on its own event).

    Runs on the current stream; on CUDA it never syncs the host.

    Raises:
        ValueError: mismatched shapes/dtypes/layouts, or pages outside the pool.
    """
    _check(dst, src, base, "gather_head_pages")
    if _use_kernel(dst, src, backend):
        _launch(dst, src, base, 0, pairs, count, valid, num_programs, pages)
    else:
        gather_head_pages_ref(dst, base, src, pairs, count, valid, pages)


def scatter_head_pages(
    dst: torch.Tensor,
    src: torch.Tensor,
    base: int,
    pairs: torch.Tensor,
    count: torch.Tensor,
    num_programs: int = DEFAULT_PROGRAMS,
    backend: str = "auto",
    pages: tuple[int, int] | None = None,
) -> None:
    """``dst[j, :, h] = src[base + j, :, h]`` for each listed tile (the write-back of :func:`gather_head_pages`).

    Args:
        dst: [m, S, Hkv, D] with the pool's page layout (a layer's host span; pinned on CUDA).
        src: [P, S, Hkv, D] contiguous (the GPU pool); ``base``: pool page of ``dst``'s page 0.
        pairs, count: from :func:`head_pairs` over an [m, Hkv] mask, on ``src``'s device.
        num_programs, backend, pages: as :func:`gather_head_pages`.

    Raises:
        ValueError: as :func:`gather_head_pages`.
    """
    _check(src, dst, base, "scatter_head_pages")
    if _use_kernel(src, dst, backend):
        _launch(dst, src, 0, base, pairs, count, None, num_programs, pages)
    else:
        scatter_head_pages_ref(dst, src, base, pairs, count, pages)
