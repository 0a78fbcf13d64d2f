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
* :func:`stash_head_tiles` / :func:`unstash_head_tiles` copy the first ``C`` listed tiles between the
  pool and a compact device buffer ``[C, S, D]`` (list entry ``i`` at ``[i]``): the offload store keeps
  a layer's staged K/V tiles there from the Stage-2 forward to that layer's backward, so the backward
  does not read them over PCIe again.

On CUDA with a host ``src``/``dst`` these are Triton kernels (:mod:`oomb.ops.triton.page_gather`, imported
on first use; without Triton, or on CPU, PyTorch index operations) that read or write page-locked host
memory directly over PCIe (zero-copy: under unified virtual addressing a pinned host tensor's
address is valid on the device), with a small persistent grid (``num_programs``) so that the copy
leaves most SMs to the compute running beside it; ``num_warps`` and ``elems_per_load`` set the kernel's warps
per program and elements per load (the ``page_gather_*`` fields of :class:`oomb.config.KernelConfig`). One tile is ``S`` rows of ``D`` contiguous
elements, ``Hkv * D`` elements apart. The PyTorch path is :func:`gather_head_pages_ref` /
:func:`scatter_head_pages_ref`; the tests also run the kernel under the Triton interpreter.

Shape legend: m pages of the source span, S page_size (tokens), Hkv KV heads, D head dim, P pool
pages. Units: pages and tokens; ``count`` is in tiles.
"""

from __future__ import annotations

import torch

__all__ = [
    "DEFAULT_PROGRAMS",
    "check_launch_args",
    "head_pairs",
    "gather_head_pages",
    "gather_head_pages_ref",
    "scatter_head_pages",
    "scatter_head_pages_ref",
    "stash_head_tiles",
    "stash_head_tiles_ref",
    "unstash_head_tiles",
    "unstash_head_tiles_ref",
]

DEFAULT_PROGRAMS = 8
"""Persistent programs of a copy kernel (of 132 SMs on an H200). With 16 warps each (the kernel's default), 8 programs
keep enough requests in flight to fill PCIe while holding 8 SMs, not 32 (the attention kernels beside the copies
cannot share an SM with them). H200 (docs/tuning.md): 256K with every page offloaded, Stage 2 73.6 s against 74.6 s
with 32 programs of 4 warps (one run each, ~1 s noise); with 4 staging sets the 1M step 279.2 against 284.4 s
(same bytes; the autotuner also picked another tile for one dense kernel in the faster run)."""

NUM_WARPS_RANGE = (1, 32)
"""Allowed ``num_warps`` of the copy kernels (a power of two in this range)."""

ELEMS_PER_LOAD_RANGE = (128, 65536)
"""Allowed ``elems_per_load`` of the copy kernels (a power of two in this range)."""


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

    Raises:
        ValueError: a mask that is not a 2-D bool tensor; ``out`` of the wrong shape or dtype.
    """
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"head_pairs: mask must be a bool [m, Hkv] tensor; got {mask.dtype} {tuple(mask.shape)}")
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


def _check(pool, span, base, pairs, count, valid, pages, what) -> tuple[int, int]:
    """Validate a tile copy between ``pool`` [P, S, Hkv, D] and ``span`` [m, S, Hkv, D]; the page range to copy,
    clamped to the span (so no listed tile can address a page outside it)."""
    if pool.dim() != 4 or span.dim() != 4 or pool.shape[1:] != span.shape[1:]:
        raise ValueError(f"{what}: pool {tuple(pool.shape)} and span {tuple(span.shape)} must be [*, S, Hkv, D] alike")
    if pool.dtype != span.dtype:
        raise ValueError(f"{what}: pool dtype {pool.dtype} != span dtype {span.dtype}")
    if not (pool.is_contiguous() and span.stride() == pool.stride()):
        raise ValueError(f"{what}: pool must be contiguous and the span's pages laid out like the pool's")
    if isinstance(base, bool) or not isinstance(base, int):
        raise ValueError(f"{what}: base must be an int (a pool page); got {base!r}")
    m, Hkv = span.shape[0], span.shape[2]
    if base < 0 or base + m > pool.shape[0]:
        raise ValueError(f"{what}: pages [{base}, {base + m}) are outside the pool's {pool.shape[0]}")
    for name, t, shape in (("pairs", pairs, None), ("count", count, (1,))):
        if t.dtype != torch.int32 or t.dim() != 1 or t.numel() < 1 or (shape is not None and tuple(t.shape) != shape):
            raise ValueError(f"{what}: {name} must be int32 [{'n' if shape is None else 1}] (from head_pairs); "
                             f"got {t.dtype} {tuple(t.shape)}")
        if t.device != pool.device:
            raise ValueError(f"{what}: {name} is on {t.device}, the pool on {pool.device}")
    if valid is not None and (valid.dtype != torch.bool or tuple(valid.shape) != (m, Hkv)
                              or not valid.is_contiguous() or valid.device != pool.device):
        raise ValueError(f"{what}: valid must be a contiguous bool [{m}, {Hkv}] tensor on {pool.device}; "
                         f"got {valid.dtype} {tuple(valid.shape)} on {valid.device}")
    lo, hi = (0, m) if pages is None else pages
    if isinstance(lo, bool) or isinstance(hi, bool) or not isinstance(lo, int) or not isinstance(hi, int) or lo < 0:
        raise ValueError(f"{what}: pages must be (lo, hi) with 0 <= lo; got {pages!r}")
    return lo, max(lo, min(hi, m))


def _tiles(pairs: torch.Tensor, count: torch.Tensor, Hkv: int, pages, entries=(0, None), with_index=False):
    """(page j, head h) long index vectors of the listed tiles with j in ``pages`` [lo, hi) and list entry i in
    ``entries`` [i_lo, i_hi) (i_hi None: all), plus i with ``with_index`` (syncs: reference path only)."""
    n = min(int(count.item()), pairs.numel())
    if entries[1] is not None:
        n = min(n, entries[1])
    i = torch.arange(min(entries[0], n), n, device=pairs.device)
    idx = pairs[i].long()
    j, h = idx // Hkv, idx % Hkv
    keep = (j >= pages[0]) & (j < pages[1])
    return (j[keep], h[keep], i[keep]) if with_index else (j[keep], h[keep])


def gather_head_pages_ref(dst, base, src, pairs, count, valid=None, pages=None, first=0) -> None:
    """PyTorch reference of :func:`gather_head_pages` (same arguments, unchecked; syncs on ``count``)."""
    j, h = _tiles(pairs, count, src.shape[2], (0, src.shape[0]) if pages is None else pages, (first, None))
    if j.numel() == 0:
        return
    jd, hd = j.to(dst.device), h.to(dst.device)
    tiles = src[j.to(src.device), :, h.to(src.device)].to(dst.device)  # [n, S, D]
    if valid is not None:
        keep = valid[j.to(valid.device), h.to(valid.device)].to(dst.device)
        tiles = torch.where(keep[:, None, None], tiles, torch.zeros((), dtype=tiles.dtype, device=dst.device))
    dst[base + jd, :, hd] = tiles


def scatter_head_pages_ref(dst, src, base, pairs, count, pages=None) -> None:
    """PyTorch reference of :func:`scatter_head_pages` (same arguments, unchecked; syncs on ``count``)."""
    j, h = _tiles(pairs, count, dst.shape[2], (0, dst.shape[0]) if pages is None else pages)
    if j.numel() == 0:
        return
    tiles = src[(base + j).to(src.device), :, h.to(src.device)].to(dst.device)
    dst[j.to(dst.device), :, h.to(dst.device)] = tiles


def _check_pow2(name: str, value, lo: int, hi: int, what: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not (lo <= value <= hi and value & (value - 1) == 0):
        raise ValueError(f"{what}: {name} must be a power of two from {lo} to {hi}, or None for the kernel's default; "
                         f"got {value!r}")


def check_launch_args(num_programs: int = DEFAULT_PROGRAMS, num_warps: int | None = None,
                      elems_per_load: int | None = None, what: str = "page_gather") -> None:
    """Validate the copy kernels' launch settings (the copies check them on every call; a caller may check them
    before it allocates anything).

    Args:
        num_programs: persistent programs (SMs), a positive int.
        num_warps: warps per program, a power of two in :data:`NUM_WARPS_RANGE`, or None (the kernel's default, 16).
        elems_per_load: elements one program moves per load/store, a power of two in :data:`ELEMS_PER_LOAD_RANGE`,
            or None (the kernel's default, 16,384).
        what: the operation named in the error.

    Raises:
        ValueError: a value out of range, naming the argument.
    """
    if isinstance(num_programs, bool) or not isinstance(num_programs, int) or num_programs < 1:
        raise ValueError(f"{what}: num_programs must be a positive int; got {num_programs!r}")
    _check_pow2("num_warps", num_warps, *NUM_WARPS_RANGE, what)
    _check_pow2("elems_per_load", elems_per_load, *ELEMS_PER_LOAD_RANGE, what)


def _triton_kernel():
    """The Triton launcher :func:`oomb.ops.triton.page_gather.launch_copy_tiles` (imported on first use: Triton is
    an optional dependency), or None."""
    try:
        from .triton.page_gather import launch_copy_tiles
    except Exception:  # pragma: no cover - depends on the installation
        return None
    return launch_copy_tiles


def _use_kernel(pool: torch.Tensor, span: torch.Tensor, backend: str) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch'; got {backend!r}")
    if backend == "torch":
        return False
    if backend == "auto" and not (pool.device.type == "cuda" and (span.device.type == "cuda" or span.is_pinned())):
        return False
    if _triton_kernel() is None:
        if backend == "triton":
            raise ValueError("backend='triton' needs Triton (pip install 'oomb[triton]'); use backend='torch'")
        return False
    return True


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
    first: int = 0,
    num_warps: int | None = None,
    elems_per_load: int | None = None,
) -> None:
    """``dst[base + j, :, h] = src[j, :, h]`` for each listed tile (zeros where ``valid[j, h]`` is False).

    Args:
        dst: [P, S, Hkv, D] contiguous (the GPU pool).
        base: pool page of ``src``'s page 0.
        src: [m, S, Hkv, D] with the pool's page layout (a layer's host span; pinned on CUDA).
        pairs, count: int32, from :func:`head_pairs` over a [rows, Hkv] mask (the same Hkv), on ``dst``'s
            device. Listed tiles of pages ``j >= m`` are skipped (the mask may have more rows than ``src``).
        valid: optional contiguous bool [m, Hkv] on ``dst``'s device: False tiles are zero-filled, not read.
        num_programs: persistent programs (SMs) of the CUDA kernel.
        backend: ``'auto'`` (the Triton kernel for a CUDA pool and a CUDA or pinned span when Triton is
            installed, else PyTorch index operations), ``'triton'`` (the kernel; on CPU only under
            ``TRITON_INTERPRET=1``) or ``'torch'``.
        pages: optional [lo, hi): only the listed tiles of pages lo <= j < hi (a piece of a larger copy that
            waits on its own event).
        first: skip the first ``first`` list entries (those a :func:`unstash_head_tiles` supplies).
        num_warps, elems_per_load: the kernel's warps per program and elements per load (see
            :func:`check_launch_args`); None: its defaults.

    Runs on the current stream; on CUDA with the kernel it never syncs the host (the PyTorch path reads
    ``count``).

    Raises:
        ValueError: mismatched shapes/dtypes/layouts/devices, pages outside the pool, a bad ``valid``,
            ``num_programs``, ``num_warps``, ``elems_per_load``, ``pages``, ``first`` or ``backend``; ``'triton'``
            without Triton installed.
    """
    pages = _check(dst, src, base, pairs, count, valid, pages, "gather_head_pages")
    check_launch_args(num_programs, num_warps, elems_per_load, "gather_head_pages")
    _check_entries(first, "gather_head_pages")
    if _use_kernel(dst, src, backend):
        _triton_kernel()(dst, src, base, 0, pairs, count, valid, num_programs, pages, (first, None),
                         num_warps=num_warps, elems_per_load=elems_per_load)
    else:
        gather_head_pages_ref(dst, base, src, pairs, count, valid, pages, first)


def scatter_head_pages(
    dst: torch.Tensor,
    src: torch.Tensor,
    base: int,
    pairs: torch.Tensor,
    count: torch.Tensor,
    num_programs: int = DEFAULT_PROGRAMS,
    backend: str = "auto",
    pages: tuple[int, int] | None = None,
    num_warps: int | None = None,
    elems_per_load: int | None = None,
) -> None:
    """``dst[j, :, h] = src[base + j, :, h]`` for each listed tile (the write-back of :func:`gather_head_pages`).

    Args:
        dst: [m, S, Hkv, D] with the pool's page layout (a layer's host span; pinned on CUDA).
        src: [P, S, Hkv, D] contiguous (the GPU pool); ``base``: pool page of ``dst``'s page 0.
        pairs, count: as :func:`gather_head_pages` (tiles of pages ``j >= m`` are skipped), on ``src``'s device.
        num_programs, backend, pages, num_warps, elems_per_load: as :func:`gather_head_pages`.

    Raises:
        ValueError: as :func:`gather_head_pages`.
    """
    pages = _check(src, dst, base, pairs, count, None, pages, "scatter_head_pages")
    check_launch_args(num_programs, num_warps, elems_per_load, "scatter_head_pages")
    if _use_kernel(src, dst, backend):
        _triton_kernel()(dst, src, 0, base, pairs, count, None, num_programs, pages, num_warps=num_warps,
                         elems_per_load=elems_per_load)
    else:
        scatter_head_pages_ref(dst, src, base, pairs, count, pages)


def _check_entries(first, what: str) -> None:
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"{what}: first must be an int >= 0 (list entries to skip); got {first!r}")


def _check_stash(stash, pool, base, num_pages, pairs, count, what) -> None:
    """Validate a copy between ``stash`` [C, S, D] and pages [base, base + num_pages) of ``pool`` [P, S, Hkv, D]."""
    if pool.dim() != 4 or stash.dim() != 3 or stash.shape[1] != pool.shape[1] or stash.shape[2] != pool.shape[3]:
        raise ValueError(f"{what}: stash {tuple(stash.shape)} must be [C, S, D] for a pool [P, S, Hkv, D] "
                         f"{tuple(pool.shape)}")
    if stash.dtype != pool.dtype or stash.device != pool.device:
        raise ValueError(f"{what}: stash ({stash.dtype}, {stash.device}) and pool ({pool.dtype}, {pool.device}) "
                         "must have one dtype and device")
    if not (stash.is_contiguous() and pool.is_contiguous()):
        raise ValueError(f"{what}: stash and pool must be contiguous")
    for name, v in (("base", base), ("num_pages", num_pages)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{what}: {name} must be an int >= 0; got {v!r}")
    if base + num_pages > pool.shape[0]:
        raise ValueError(f"{what}: pages [{base}, {base + num_pages}) are outside the pool's {pool.shape[0]}")
    _check(pool, pool[base : base + num_pages], base, pairs, count, None, None, what)


def stash_head_tiles_ref(stash, pool, base, num_pages, pairs, count) -> None:
    """PyTorch reference of :func:`stash_head_tiles` (same arguments, unchecked; syncs on ``count``)."""
    j, h, i = _tiles(pairs, count, pool.shape[2], (0, num_pages), (0, stash.shape[0]), with_index=True)
    if i.numel():
        stash[i] = pool[base + j, :, h]


def unstash_head_tiles_ref(pool, base, num_pages, stash, pairs, count) -> None:
    """PyTorch reference of :func:`unstash_head_tiles` (same arguments, unchecked; syncs on ``count``)."""
    j, h, i = _tiles(pairs, count, pool.shape[2], (0, num_pages), (0, stash.shape[0]), with_index=True)
    if i.numel():
        pool[base + j, :, h] = stash[i]


def stash_head_tiles(
    stash: torch.Tensor,
    pool: torch.Tensor,
    base: int,
    num_pages: int,
    pairs: torch.Tensor,
    count: torch.Tensor,
    num_programs: int = DEFAULT_PROGRAMS,
    backend: str = "auto",
    num_warps: int | None = None,
    elems_per_load: int | None = None,
) -> None:
    """``stash[i] = pool[base + j_i, :, h_i]`` for the list entries ``i < min(count, C)`` (tile ``(j_i, h_i)``
    named by ``pairs[i]``); entries of pages ``j_i >= num_pages`` are skipped.

    Args:
        stash: [C, S, D] contiguous, the pool's dtype and device (C tiles of one KV head each).
        pool: [P, S, Hkv, D] contiguous; ``base``: pool page of the span's page 0; ``num_pages``: the span's pages.
        pairs, count: int32, from :func:`head_pairs`, on the pool's device.
        num_programs, backend, num_warps, elems_per_load: as :func:`gather_head_pages` (the kernel for a CUDA pool
            when Triton is installed).

    Runs on the current stream; device to device, without a host sync on CUDA.

    Raises:
        ValueError: mismatched shapes/dtypes/devices, pages outside the pool, a bad ``num_programs``, ``num_warps``,
            ``elems_per_load`` or ``backend``.
    """
    _check_stash(stash, pool, base, num_pages, pairs, count, "stash_head_tiles")
    check_launch_args(num_programs, num_warps, elems_per_load, "stash_head_tiles")
    if _use_kernel(pool, pool, backend):
        _triton_kernel()(stash, pool, 0, base, pairs, count, None, num_programs, (0, num_pages), (0, stash.shape[0]),
                         dst_compact=True, num_warps=num_warps, elems_per_load=elems_per_load)
    else:
        stash_head_tiles_ref(stash, pool, base, num_pages, pairs, count)


def unstash_head_tiles(
    pool: torch.Tensor,
    base: int,
    num_pages: int,
    stash: torch.Tensor,
    pairs: torch.Tensor,
    count: torch.Tensor,
    num_programs: int = DEFAULT_PROGRAMS,
    backend: str = "auto",
    num_warps: int | None = None,
    elems_per_load: int | None = None,
) -> None:
    """``pool[base + j_i, :, h_i] = stash[i]`` for the list entries ``i < min(count, C)``: the inverse of
    :func:`stash_head_tiles` with the same list (then :func:`gather_head_pages` with ``first=C`` supplies the rest).

    Args and Raises: as :func:`stash_head_tiles`.
    """
    _check_stash(stash, pool, base, num_pages, pairs, count, "unstash_head_tiles")
    check_launch_args(num_programs, num_warps, elems_per_load, "unstash_head_tiles")
    if _use_kernel(pool, pool, backend):
        _triton_kernel()(pool, stash, base, 0, pairs, count, None, num_programs, (0, num_pages), (0, stash.shape[0]),
                         src_compact=True, num_warps=num_warps, elems_per_load=elems_per_load)
    else:
        unstash_head_tiles_ref(pool, base, num_pages, stash, pairs, count)
