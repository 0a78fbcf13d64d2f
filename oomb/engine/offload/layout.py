"""Allocation of an offloaded KV store: the GPU pool (K and dK sharing one allocation), the pinned host tier, and
the int32 block tables that map a layer's pages to pool slots (docs/design.md §2.3)."""

from __future__ import annotations

import math
import warnings

import torch

__all__ = ["host_empty", "pool_pair", "segment_tables", "unregister_host", "whole_layer_tables"]


def pool_pair(shape: tuple[int, ...], dtype: torch.dtype, grad_dtype: torch.dtype, device: torch.device):
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


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool, pins: list[int]) -> torch.Tensor:
    """Host tensor of ``shape``; page-locked when ``pin`` (a CUDA device will copy from/to it).

    ``torch.empty(pin_memory=True)`` rounds every pinned block up to a power of two
    (PyTorch's CachingHostAllocator), which would waste up to half of host RAM at the sizes
    planned here, so the tensor is allocated pageable and registered with cudaHostRegister;
    its address is appended to ``pins``, which the owner unregisters with
    :func:`unregister_host` when it is collected. Falls back to ``pin_memory=True`` (with a
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


def unregister_host(ptrs: list[int], tensors: list[torch.Tensor]) -> None:
    cudart = torch.cuda.cudart()
    for ptr in ptrs:
        cudart.cudaHostUnregister(ptr)
    tensors.clear()


def whole_layer_tables(L: int, n: int, R: int, K: int, W: int, shadow_pages: int, shadow_base: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block tables of whole-layer staging -> ``(table, table1)``, int32 ``[L, n]`` on ``device``.

    ``table``: layer ``l``'s page ``p`` -> resident slot ``l*R + p`` (p < R), else slot ``L*R + (l % K)*W + p - R``
    of staging set ``l % K``. ``table1`` (Stage 1 with a shadow of ``shadow_pages`` pages, else None): the same, but
    host pages ``[R, R + Sh)`` of layer ``l`` at slots ``shadow_base + l*Sh + (p - R)`` of the views over the dK/dV
    bytes."""
    table = torch.empty((L, n), dtype=torch.int32)
    for layer in range(L):
        table[layer, :R] = torch.arange(layer * R, layer * R + R, dtype=torch.int32)
        base = L * R + (layer % K) * W
        table[layer, R:] = torch.arange(base, base + W, dtype=torch.int32)
    table1 = None
    Sh = shadow_pages
    if Sh:
        t1 = table.clone()
        for layer in range(L):
            t1[layer, R : R + Sh] = torch.arange(shadow_base + layer * Sh, shadow_base + (layer + 1) * Sh,
                                                 dtype=torch.int32)
        table1 = t1.to(device)
    return table.to(device), table1


def segment_tables(L: int, n: int, R: int, W: int, pool_pages: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables of segment staging -> ``(first, ramp)`` on ``device``.

    ``first`` int32 ``[2, L, R + W]``: segment 0 of layer ``l`` in buffer ``b`` reads slots
    ``[l*R .. l*R+R-1 (resident), base(b) .. base(b)+W-1]``, ``base(b) = L*R + b*W``. ``ramp`` int32
    ``[n + pool_pages]`` = ``-n .. pool_pages - 1``: segment ``i >= 1`` (host pages from ``p0 = R + i*SP``) in buffer
    ``b`` reads page ``p`` at slot ``base(b) + p - p0``, a view of the ramp from ``n + base(b) - p0`` (entries before
    ``p0`` unused)."""
    first = torch.empty((2, L, R + W), dtype=torch.int32)
    for b in range(2):
        for layer in range(L):
            first[b, layer, :R] = torch.arange(layer * R, layer * R + R, dtype=torch.int32)
            first[b, layer, R:] = torch.arange(L * R + b * W, L * R + b * W + W, dtype=torch.int32)
    ramp = torch.arange(-n, pool_pages, dtype=torch.int32).to(device)
    return first.to(device), ramp
