"""Tensor descriptors (TMA on Hopper or newer): which launches may read their tiles through them, and the
scratch allocator descriptors built on the device need.

Each check returns False when its ``enabled`` argument is False (the ``fwd_tma`` / ``bwd_tma`` / ``dkdv_tma``
fields of :class:`oomb.config.KernelConfig`, for A/B runs and machines where descriptors misbehave).
"""

from __future__ import annotations

import torch
import triton

from .interpreter import INTERPRET

__all__ = ["qo_tma", "set_tma_allocator", "tma_capable", "tma_scratch", "use_tma"]


def tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for the descriptors a kernel builds on the device (``triton.set_allocator``)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def tma_capable(device: torch.device) -> bool:
    """Tensor descriptors: the interpreter, or a CUDA device of compute capability 9.0 (Hopper) or newer."""
    return INTERPRET or (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9)


def set_tma_allocator() -> None:
    """Give this thread's context the scratch allocator that descriptors built on the device need.

    Triton keeps the allocator in a ContextVar, i.e. per thread: setting it once on the main thread
    is not enough, since autograd runs the backward on its own device thread (a backward with
    descriptors failed there with "no allocator was set" on the H200). So it is checked on every
    launch that uses descriptors, and set where this context has none (an allocator the caller set
    is kept).
    """
    try:
        from triton.runtime import _allocation

        current = _allocation._allocator.get()
        if not isinstance(current, _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # another triton layout: set it unconditionally
        pass
    triton.set_allocator(tma_scratch)


def use_tma(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int, page_size: int, configs: list,
            enabled: bool = True) -> bool:
    """Whether a kernel reads its full past tiles through tensor descriptors (TMA on Hopper).

    Needs: ``enabled``; pools laid out [P, S, Hkv, D] densely (so a page's rows of one head are a box of the
    pool seen as [P * S, Hkv * D]), a power-of-two head dim (the box is HEAD_DIM wide), pages a
    multiple of every autotuned BLOCK_N of ``configs`` (the launched kernel's config list; a full tile never
    straddles two pages), 16-byte aligned bases and fewer than 2**31 rows; the launcher adds a
    page-aligned ``past_start``. Packed documents keep the gather path (their tiles are masked).
    """
    if not enabled:
        return False
    P, S, Hkv, D = k_cache.shape
    dense = (S * Hkv * D, Hkv * D, D, 1)
    block_n = max(c.kwargs["BLOCK_N"] for c in configs)
    ok = (
        k_cache.stride() == dense and v_cache.stride() == dense and tuple(v_cache.shape) == (P, S, Hkv, D)
        and head_dim == triton.next_power_of_2(head_dim) and head_dim >= 16 and page_size % block_n == 0
        and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0 and P * S < 2**31
        and tma_capable(k_cache.device)
    )
    if ok:
        set_tma_allocator()
    return ok


def qo_tma(q: torch.Tensor, dout: torch.Tensor, head_dim: int, enabled: bool = True) -> bool:
    """Whether the dk/dv kernel loads its q/dout row tiles through [Hq, C, D] tensor descriptors.

    A row tile of the dk/dv kernel is BLOCK_M consecutive queries of one head, i.e. a box of q
    seen as [Hq, C, D] with strides (stride_h, stride_c, 1), for both layouts the engine passes
    ([C, Hq, D] contiguous and HF's transposed [Hq, C, D]). Needs ``enabled``, a unit innermost stride, 16-byte
    aligned outer strides and bases, and a power-of-two head dim (the box is HEAD_DIM wide); rows
    past C are zero-filled by the descriptor as the masked gather fills them.
    """
    if not enabled:
        return False
    ok = head_dim == triton.next_power_of_2(head_dim) and head_dim >= 16 and tma_capable(q.device)
    for t in (q, dout):
        e = t.element_size()
        ok = ok and t.stride(2) == 1 and (t.stride(0) * e) % 16 == 0 and (t.stride(1) * e) % 16 == 0 and t.data_ptr() % 16 == 0
    if ok:
        set_tma_allocator()
    return ok
