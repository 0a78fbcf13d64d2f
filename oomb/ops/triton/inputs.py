"""What the Triton attention launchers share: input checks, output allocation, the dot precision and the
``delta`` of the backward. Shapes as in :mod:`oomb.ops.triton.paged_attention`.
"""

from __future__ import annotations

import math

import torch

from .interpreter import INTERPRET

__all__ = ["LOG2E", "_alloc", "_alloc_like", "_cache_args", "_check_doc", "_check_inputs", "_check_part", "_delta",
           "_dot_precision", "_drain_streams_before_first_tune"]

LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256


def _alloc_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Uninitialised output with x's shape and memory layout (tests patch this to poison outputs)."""
    return torch.empty_like(x, dtype=dtype)


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised contiguous output (tests patch this to poison outputs)."""
    return torch.empty(shape, dtype=dtype, device=device)


_TUNE_KEYS_SEEN: set = set()


def _drain_streams_before_first_tune(name: str, q: torch.Tensor, key: dict) -> None:
    """Wait for every stream before the first launch, in this process, of an autotuned kernel that has
    ``restore_value`` (it adds into dK/dV) for this autotune ``key``.

    Autotuning such a kernel clones its output tensors (here the whole dK/dV page pool), runs every
    config, then copies the clones back, on the current stream. A copy stream writing into the pool
    meanwhile (the offload store's prefetch of the next layer's dK/dV) would have its writes undone
    by that restore. Draining first makes the pool quiet: autotuning blocks the host until it ends,
    so nothing new is enqueued during it. Later launches (a tuned key) do not wait. No-op off CUDA.
    """
    if not q.is_cuda:
        return
    k = (name, q.dtype, tuple(sorted(key.items())))
    if k not in _TUNE_KEYS_SEEN:
        torch.cuda.synchronize(q.device)
        _TUNE_KEYS_SEEN.add(k)



def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 or INTERPRET else "tf32"


def _check_inputs(q, k, v, k_cache, v_cache, block_table, past_len, softmax_scale):
    """Validate the forward inputs; returns (C, Hq, Hkv, D, page_size, scale)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [C, H, D]; got {getattr(t, 'shape', type(t))}")
    C, Hq, D = q.shape
    if k.shape != v.shape or k.shape[0] != C or k.shape[2] != D:
        raise ValueError(f"k and v must be [C={C}, Hkv, D={D}]; got {tuple(k.shape)} and {tuple(v.shape)}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be one of {_SUPPORTED_DTYPES}; got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not 1 <= D <= _MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [1, {_MAX_HEAD_DIM}]; got {D}")
    dev = q.device
    if k.device != dev or v.device != dev:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if dev.type != "cuda" and not (INTERPRET and dev.type == "cpu"):
        raise ValueError(f"the Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1); got {dev}")
    if not isinstance(past_len, int) or past_len < 0:
        raise ValueError(f"past_len must be an int >= 0; got {past_len!r}")
    page_size = 1
    if past_len > 0:
        if k_cache is None or v_cache is None or block_table is None:
            raise ValueError("past_len > 0 needs k_cache, v_cache and block_table")
        if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2] != Hkv or k_cache.shape[3] != D:
            raise ValueError(
                f"k_cache/v_cache must be [P, page_size, Hkv={Hkv}, D={D}]; got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
            )
        if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
            raise ValueError(f"k_cache/v_cache dtype must equal q's ({q.dtype}); got {k_cache.dtype}, {v_cache.dtype}")
        if k_cache.device != dev or v_cache.device != dev or block_table.device != dev:
            raise ValueError(f"k_cache, v_cache and block_table must be on {dev}")
        page_size = k_cache.shape[1]
        need = -(-past_len // page_size)
        if block_table.dim() != 1 or block_table.dtype != torch.int32 or block_table.numel() < need:
            raise ValueError(
                f"block_table must be 1-D int32 with >= {need} pages for past_len={past_len} and page_size={page_size}; "
                f"got {block_table.dtype} {tuple(block_table.shape)}"
            )
        if block_table.stride(0) != 1:
            raise ValueError("block_table must be contiguous")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(D)
    return C, Hq, Hkv, D, page_size, scale


def _check_part(past_start, past_len, include_own):
    if not isinstance(past_start, int) or isinstance(past_start, bool) or not 0 <= past_start <= past_len:
        raise ValueError(f"past_start must be an int in [0, past_len={past_len}]; got {past_start!r}")
    if not include_own and past_start == past_len:
        raise ValueError("include_own=False needs at least one past token (past_start < past_len)")


def _delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """rowsum(dout * out) in fp32 -> contiguous [Hq, C] (the layout of lse)."""
    return (dout.float() * out.float()).sum(-1).t().contiguous()


def _check_doc(q_doc_start, C, past_len, device):
    """Validate q_doc_start -> contiguous int32 [C] on ``device``, or None."""
    if q_doc_start is None:
        return None
    if not isinstance(q_doc_start, torch.Tensor) or q_doc_start.shape != (C,):
        raise ValueError(f"q_doc_start must be an int tensor [C={C}]; got {getattr(q_doc_start, 'shape', type(q_doc_start))}")
    if q_doc_start.dtype not in (torch.int32, torch.int64) or q_doc_start.device != device:
        raise ValueError(f"q_doc_start must be int32/int64 on {device}; got {q_doc_start.dtype} on {q_doc_start.device}")
    return q_doc_start.to(torch.int32).contiguous()


def _cache_args(k_cache, v_cache, block_table, past_len, like):
    """Pool pointers and strides; with no past, dummies that the kernels never read."""
    if past_len > 0:
        return k_cache, v_cache, block_table, k_cache.stride(), v_cache.stride()
    dummy_bt = torch.zeros(1, dtype=torch.int32, device=like.device)
    return like, like, dummy_bt, (0, 0, 0, 0), (0, 0, 0, 0)


