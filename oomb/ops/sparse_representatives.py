"""Page representatives of sparse attention (docs/design.md §2.4): a small summary per (page, KV head) of its keys.

When a chunk's post-RoPE keys are written (Stage 1) each page gets, per KV head, the mean of its keys (MoBA;
OOMB's published choice; score ``'mean'``) or the element-wise min and max (score ``'quest'``: Tang et al. 2024,
"Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", §3.2). A partial page is summarised over
its valid tokens only. Kept on the device in the accumulation dtype (float32; float64 for float64 models):
``[num_layers, max_pages, Hkv, D]`` (twice that for Quest), indexed by LOGICAL page (token ``t`` is in page
``t // page_size``), so it does not depend on which pool page holds the tokens or on where the store keeps them.

Memory: ``L * ceil(T / S) * Hkv * D * 4`` bytes (twice for Quest; Qwen2.5-7B at 1M tokens: 0.44 GiB).
Shape legend: Hkv KV heads, D head dim, S page_size (tokens), L layers, T sequence tokens.
"""

from __future__ import annotations

import torch

from .attention_ref import acc_dtype_for

__all__ = ["SCORES", "PageRepresentatives", "page_representatives"]

SCORES = ("mean", "quest")
"""The page scores: 'mean' (q_sum . mean of the page's keys) and 'quest' (an upper bound from the key min/max)."""


# ----------------------------------------------------------------------------- representatives
def page_representatives(k: torch.Tensor, page_size: int, score: str = "mean") -> tuple[torch.Tensor, ...]:
    """Per-page summaries of consecutive keys.

    Args:
        k: [n, Hkv, D] post-RoPE keys starting at a page boundary (the last page may be partial).
        page_size: S, tokens per page.
        score: 'mean' or 'quest'.

    Returns:
        'mean': ``(mean,)``; 'quest': ``(kmin, kmax)``; each [ceil(n / S), Hkv, D] in the
        accumulation dtype (float32, float64 for float64 keys), over the valid tokens of each page.
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    n, Hkv, D = k.shape
    S = page_size
    n_pages = -(-n // S)
    acc = acc_dtype_for(k.dtype)
    if n_pages == 0:
        return tuple(torch.zeros(0, Hkv, D, dtype=acc, device=k.device) for _ in range(1 if score == "mean" else 2))
    kp = torch.zeros(n_pages * S, Hkv, D, dtype=acc, device=k.device)
    kp[:n] = k.to(acc)
    kp = kp.view(n_pages, S, Hkv, D)
    if score == "mean":
        counts = torch.full((n_pages,), S, dtype=acc, device=k.device)
        counts[-1] = n - (n_pages - 1) * S
        return (kp.sum(1) / counts[:, None, None],)
    valid = (torch.arange(n_pages * S, device=k.device) < n).view(n_pages, S, 1, 1)
    kmin = torch.where(valid, kp, torch.inf).amin(1)
    kmax = torch.where(valid, kp, -torch.inf).amax(1)
    return kmin, kmax


class PageRepresentatives:
    """Page summaries of every layer of one sequence, on the device, by logical page.

    Args:
        num_layers, num_kv_heads, head_dim: model shape.
        max_pages: pages per layer (ceil(T / page_size)).
        page_size: S in tokens.
        score: 'mean' (one [L, max_pages, Hkv, D] tensor) or 'quest' (min and max: two).
        dtype: accumulation dtype (float32; float64 for float64 models).
        device: where they live (the GPU in training).
    """

    def __init__(self, num_layers, num_kv_heads, head_dim, max_pages, page_size, score, dtype, device) -> None:
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        self.page_size, self.score, self.max_pages = page_size, score, max_pages
        shape = (num_layers, max_pages, num_kv_heads, head_dim)
        self.tensors = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(1 if score == "mean" else 2))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def write(self, layer: int, start: int, k: torch.Tensor) -> None:
        """Summarise keys ``k [n, Hkv, D]`` of tokens [start, start + n) of ``layer`` (start page-aligned)."""
        if start % self.page_size:
            raise ValueError(f"representatives: start {start} is not page-aligned (page_size {self.page_size})")
        p0 = start // self.page_size
        for dst, src in zip(self.tensors, page_representatives(k, self.page_size, self.score)):
            dst[layer, p0 : p0 + src.shape[0]] = src.to(dst.dtype)

    def layer(self, layer: int, n_pages: int) -> tuple[torch.Tensor, ...]:
        """Summaries of the first ``n_pages`` pages of ``layer``: views [n_pages, Hkv, D]."""
        return tuple(t[layer, :n_pages] for t in self.tensors)
