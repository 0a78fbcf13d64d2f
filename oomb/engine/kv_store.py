"""Paged KV store: K/V pages and fp32 dK/dV pages from one preallocated pool.

A page holds ``page_size`` consecutive tokens of ONE layer, all KV heads:
``k_cache[page] -> [page_size, Hkv, D]``. Each layer's tokens are addressed
through its row of an int32 ``block_table`` (vLLM's term): token ``t`` of layer
``l`` lives at ``k_cache[block_table[l, t // page_size], t % page_size]``.
KV heads are stored as they are (GQA never expanded). Gradient pages use
float32 (float64 for a float64 model): bf16 accumulation over hundreds of
chunks would lose precision (docs/design.md §2.2).

Pages are taken from a free list when a chunk's K/V are written (Stage 1) and
returned as soon as Stage 2 has passed that chunk; the pool itself is allocated
once and reused by later steps of the same or a smaller size.

Each layer owns one region of ``max_pages_per_layer`` consecutive pages
(``[l * M, (l + 1) * M)``) and hands them out in ascending order, so a layer's
past is normally ONE contiguous ``[past_len, Hkv, D]`` run of the pool: the
views :meth:`PagedKVStore.attention_view` then also passes (``PagedKV.past_runs``
and ``past_grad_runs``, one run each) let the fused SDPA path (:mod:`oomb.ops.sdpa_attention`)
read it without a block table. Where the pages are not in order (tests shuffle the free
lists), there are no runs and the block-table kernels serve the call.
"""

from __future__ import annotations

import torch

from ..ops.paged_attention import PagedKV

__all__ = ["PagedKVStore"]


class PagedKVStore:
    """Page pool for the K/V and dK/dV of one training sequence.

    Args:
        num_layers: decoder layers.
        num_kv_heads: KV heads per layer (Hkv).
        head_dim: D.
        page_size: tokens per page (S).
        num_pages: pages in the pool (P); a sequence of T tokens needs ``num_layers * ceil(T / S)``.
        dtype: K/V dtype (the model's).
        device: where the pool lives.
        grad_dtype: dK/dV dtype; default float32 (float64 for a float64 model).

    Attributes:
        k_cache, v_cache: [P, S, Hkv, D] in ``dtype``.
        dk_cache, dv_cache: [P, S, Hkv, D] in ``grad_dtype``.
        block_table: int32 [num_layers, max_pages_per_layer] page ids per layer (-1 = none).
        max_pages_per_layer: pages in each layer's region (``num_pages // num_layers``).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device | str,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        if num_pages < num_layers:
            raise ValueError(f"num_pages ({num_pages}) must hold at least one page per layer ({num_layers})")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        self.grad_dtype = grad_dtype or (torch.float64 if dtype == torch.float64 else torch.float32)
        self.device = torch.device(device)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_cache = torch.empty(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.empty(shape, dtype=dtype, device=self.device)
        self.dk_cache = torch.empty(shape, dtype=self.grad_dtype, device=self.device)
        self.dv_cache = torch.empty(shape, dtype=self.grad_dtype, device=self.device)
        self.max_pages_per_layer = num_pages // num_layers
        self.block_table = torch.full(
            (num_layers, self.max_pages_per_layer), -1, dtype=torch.int32, device=self.device
        )
        self._host_table = [[] for _ in range(num_layers)]
        self._free: list[list[int]] = [[] for _ in range(num_layers)]
        self._run = [0] * num_layers  # per layer: how many first pages are consecutive ascending pool pages
        self.reset()

    # ------------------------------------------------------------------ sizing
    @staticmethod
    def pages_needed(num_layers: int, seq_len: int, page_size: int) -> int:
        """Pages for a sequence of ``seq_len`` tokens over ``num_layers`` layers."""
        return num_layers * -(-seq_len // page_size)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, grad_dtype: torch.dtype) -> int:
        """Bytes of K+V plus dK+dV for one token over all layers."""
        per = num_layers * num_kv_heads * head_dim * 2
        return per * (torch.empty((), dtype=dtype).element_size() + torch.empty((), dtype=grad_dtype).element_size())

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool (K, V, dK, dV)."""
        return sum(t.numel() * t.element_size() for t in (self.k_cache, self.v_cache, self.dk_cache, self.dv_cache))

    def fits(self, seq_len: int) -> bool:
        """Whether a sequence of ``seq_len`` tokens fits in this pool."""
        return -(-seq_len // self.page_size) <= self.max_pages_per_layer

    # ------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        """Return every page to the free list and forget all block tables."""
        # Each layer's region handed out in ascending order (a stack: the end is popped first). The
        # order matters for speed only (contiguous past views); tests shuffle it.
        M = self.max_pages_per_layer
        self._free = [list(range((layer + 1) * M - 1, layer * M - 1, -1)) for layer in range(self.num_layers)]
        self._host_table = [[] for _ in range(self.num_layers)]
        self._run = [0] * self.num_layers
        self.block_table.fill_(-1)

    def shuffle_free_list(self, generator: torch.Generator | None = None) -> None:
        """Randomise which pool pages are handed out next (tests: block tables must not be assumed sorted)."""
        for free in self._free:
            perm = torch.randperm(len(free), generator=generator).tolist()
            free[:] = [free[i] for i in perm]

    @property
    def num_free_pages(self) -> int:
        return sum(len(free) for free in self._free)

    def num_layer_pages(self, layer: int) -> int:
        return len(self._host_table[layer])

    def _allocate(self, layer: int, n: int) -> list[int]:
        free = self._free[layer]
        if len(self._host_table[layer]) + n > self.max_pages_per_layer or n > len(free):
            raise RuntimeError(
                f"layer {layer} would hold {len(self._host_table[layer]) + n} pages, more than the "
                f"{self.max_pages_per_layer} this pool was sized for"
            )
        pages = [free.pop() for _ in range(n)]
        table = self._host_table[layer]
        start = len(table)
        for page in pages:
            if self._run[layer] == len(table) and (not table or page == table[-1] + 1):
                self._run[layer] += 1
            table.append(page)
        if pages == list(range(pages[0], pages[0] + n)):  # the usual case: filled on the device, no host copy (a
            # synchronous copy from pageable memory would drain the GPU queue once per chunk and layer)
            torch.arange(pages[0], pages[0] + n, dtype=torch.int32, device=self.device,
                         out=self.block_table[layer, start : start + n])
        else:
            self.block_table[layer, start : start + n] = torch.tensor(pages, dtype=torch.int32).to(self.device)
        return pages

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a chunk's K/V for ``layer`` at token offset ``start`` (a multiple of page_size).

        Args:
            k, v: [n, Hkv, D]; pages for them are allocated from the free list, and their
                gradient pages are zeroed.

        Raises:
            ValueError: if ``start`` is not page-aligned or does not follow the stored tokens.
        """
        S = self.page_size
        if start % S != 0 or start // S != len(self._host_table[layer]):
            raise ValueError(
                f"layer {layer}: write at token {start} must be page-aligned and follow the "
                f"{len(self._host_table[layer]) * S} tokens already stored"
            )
        n = k.shape[0]
        n_pages = -(-n // S)
        pages = self._allocate(layer, n_pages)
        idx = self.block_table[layer, start // S : start // S + n_pages].long()
        full = n // S
        if full:
            self.k_cache.index_copy_(0, idx[:full], k[: full * S].reshape(full, S, *k.shape[1:]).to(self.dtype))
            self.v_cache.index_copy_(0, idx[:full], v[: full * S].reshape(full, S, *v.shape[1:]).to(self.dtype))
        if n % S:
            last = pages[-1]
            self.k_cache[last, : n % S] = k[full * S :]
            self.v_cache[last, : n % S] = v[full * S :]
        self.dk_cache.index_fill_(0, idx, 0)
        self.dv_cache.index_fill_(0, idx, 0)

    # ------------------------------------------------------ engine interface
    def attention_view(
        self, layer: int, stage: int, start: int, length: int, is_last: bool, q_doc_start: torch.Tensor | None = None
    ) -> PagedKV:
        """What the attention of (chunk at token ``start``, ``layer``) reads and writes.

        Stage 1 gets the K/V pools and the past block table; Stage 2 also the gradient pools
        and, unless this is the last chunk (whose K/V no later chunk read), the block table of
        the chunk's own pages, where later chunks stored its dK/dV. A store that keeps pages
        elsewhere (host memory) overrides this to stage them in first.
        """
        S = self.page_size
        n_past = start // S
        past = self.layer_block_table(layer, n_past)
        views = {}
        if 0 < n_past <= self._run[layer]:  # the past is one run of consecutive pages: contiguous views
            p0 = self._host_table[layer][0]
            k, v, dk, dv = (pool[p0 : p0 + n_past].flatten(0, 1) for pool in (self.k_cache, self.v_cache, self.dk_cache,
                                                                            self.dv_cache))
            views["past_runs"] = ((k, v),)
            if stage == 2:
                views["past_grad_runs"] = ((dk, dv),)
        if stage == 1:
            return PagedKV(self.k_cache, self.v_cache, past, start, q_doc_start=q_doc_start, **views)
        own = None if is_last else self.layer_block_table(layer, n_past + -(-length // S))[n_past:]
        return PagedKV(self.k_cache, self.v_cache, past, start, self.dk_cache, self.dv_cache, own, q_doc_start, **views)

    def after_attention_forward(self, layer: int, stage: int) -> None:
        """Called after each attention forward (hook for stores that stage pages; no-op here)."""

    def layer_block_table(self, layer: int, num_pages: int) -> torch.Tensor:
        """int32 [num_pages] page ids of the first ``num_pages`` pages of ``layer`` (a view)."""
        return self.block_table[layer, :num_pages]

    def read_grad(self, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored dK/dV of tokens [start, start+n) of ``layer`` -> two [n, Hkv, D] tensors (grad dtype)."""
        S = self.page_size
        p0, p1 = start // S, -(-(start + n) // S)
        idx = self.block_table[layer, p0:p1].long()
        off = start - p0 * S
        dk = self.dk_cache.index_select(0, idx).flatten(0, 1)[off : off + n]
        dv = self.dv_cache.index_select(0, idx).flatten(0, 1)[off : off + n]
        return dk, dv

    def release_from(self, layer: int, start: int) -> None:
        """Return the pages of tokens [start, end) of ``layer`` to the free list (start page-aligned)."""
        S = self.page_size
        if start % S:
            raise ValueError(f"release_from: start {start} is not page-aligned (page_size {S})")
        keep = start // S
        self._run[layer] = min(self._run[layer], keep)
        pages = self._host_table[layer][keep:]
        del self._host_table[layer][keep:]
        self.block_table[layer, keep : keep + len(pages)] = -1
        self._free[layer].extend(reversed(pages))
