"""Typed configuration of the chunk-recurrent engine."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .planner_args import SPARSE_DEFAULTS

__all__ = ["OOMBConfig"]

_BACKENDS = ("auto", "torch", "triton", "sdpa")


@dataclass
class OOMBConfig:
    """Settings of one chunk-recurrent training step (DESIGN.md §2.1–2.2).

    Raises:
        ValueError: on a non-positive size, a chunk size that is not a multiple
            of the page size, an unknown attention backend, a negative sparse page count,
            an unknown sparse score, an unknown ``save_attention`` or ``grad_accum_dtype``, or a sparse option (``page_budget``, ``sink_pages``,
            ``local_pages``, ``sparse_score``) other than its default while ``sparse`` is False
            (it would be ignored). The message names the field and the fix.
    """

    chunk_size: int = 4096
    """Tokens per chunk. Activation memory scales with this, not with the sequence length."""

    page_size: int = 128
    """Tokens per KV page (one layer, all KV heads). `chunk_size` must be a multiple of it."""

    attention_backend: str = "auto"
    """'torch' (PyTorch reference), 'triton' (the paged Triton kernels for every call), 'sdpa' (PyTorch's fused
    attention -- cuDNN on CUDA, the CPU flash kernel on the CPU -- for calls whose past lies contiguously in the
    page pool, the paged kernels for the rest: offloaded, sparse and packed-document calls; on CUDA not bitwise
    reproducible run to run) or 'auto' ('sdpa' on CUDA, 'torch' on the CPU). See oomb.ops.paged_attention."""

    checkpoint_layers: bool = False
    """Per-layer activation checkpointing inside each chunk's Stage-2 recompute."""

    loss_chunk_size: int = 1024
    """Tokens per logits block in the chunked cross-entropy; logits exist for at most this many tokens."""

    attention_block_size: int = 4096
    """Past tokens per block in the memory-bounded PyTorch reference attention."""

    offload: bool | str = "auto"
    """KV pages in pinned host memory with a GPU tier (DESIGN.md §2.3): True, False, or 'auto' (CUDA: offload
    only when the planner finds that not every page fits in free GPU memory; CPU: never). 'on'/'off' = True/False."""

    gpu_page_budget: int | None = None
    """With offload: GPU page-pool size in pages (a page = page_size tokens of one layer's K, V, dK and dV),
    the staging buffers included, so at least 2 x min(offload_segment_pages, ceil(T / page_size)) (with sparse
    attention K whole layers: K = 2, or offload_staging_sets); pages beyond stay resident on the GPU. None: on
    CUDA the largest the planner
    finds room for, on CPU the minimum. Setting it implies offload (an error with offload=False)."""

    offload_staging_sets: int | None = None
    """With offload and whole-layer staging (sparse attention): staging buffers of a whole layer in the GPU pool
    (an integer >= 2). None: picked from the pool (2 to 4; ``oomb.engine.offload.choose_staging_sets``); the planner
    passes 2 where more sets would overflow the host budget. ``OOMB_OFFLOAD_STAGING_SETS`` overrides it."""

    offload_segment_pages: int | None = None
    """With offload: pages per staging segment. The attention reads a layer's non-resident past one segment at
    a time through two segment buffers, so the GPU tier does not grow with the context. None: 32768 //
    page_size (32K tokens). Sparse attention stages whole layers instead (it reads the past through one table)."""

    sparse: bool = False
    """Page-level top-K sparse attention (DESIGN.md §2.4): each block of `sparse_block_size` queries attends, per
    KV head, to `page_budget` selected past pages plus `sink_pages` first and `local_pages` latest past pages and
    its own chunk. Selected in Stage 1, reused unchanged in Stage 2. Exactly dense while the past fits."""

    page_budget: int = SPARSE_DEFAULTS["page_budget"]
    """With sparse: past pages chosen by score per (query block, KV head), beyond the sink and local pages."""

    sink_pages: int = SPARSE_DEFAULTS["sink_pages"]
    """With sparse: first pages of the sequence always attended (attention sink); 0 allowed."""

    local_pages: int = SPARSE_DEFAULTS["local_pages"]
    """With sparse: latest past pages always attended (a local window before the chunk); 0 allowed."""

    sparse_block_size: int = 128
    """With sparse: queries per selection block (tokens); every block of a chunk makes its own selection."""

    sparse_score: str = SPARSE_DEFAULTS["sparse_score"]
    """With sparse: page score: 'mean' (q_sum · mean of the page's keys; MoBA/OOMB) or 'quest' (upper bound of
    q_sum · k from the page's element-wise key min/max; Quest)."""

    save_attention: str = "off"
    """Keep Stage 1's attention outputs (out and lse of every chunk and layer) so the Stage-2 recompute skips its
    attention forward (~22% of the attention FLOPs; the gradients are unchanged): 'off', 'gpu' (on the device:
    Hq * D values + Hq float32 per token and layer, 7,280 bytes in bf16 for Qwen2.5-7B, 24.1 GiB at 128K
    tokens) or 'host' (page-locked host memory, fetched a chunk ahead; two chunks' worth on the device). With
    offload (dense: segmented staging) the Stage-2 forwards then stage no past either. Not used where offload
    stages whole layers (sparse attention), nor where they do not fit in free GPU / host memory (a warning says
    so; the step recomputes). See :mod:`oomb.engine.saved_attention`."""

    grad_accum_dtype: str = "param"
    """Dtype in which each chunk's parameter gradients are summed during a step: 'param' (autograd adds them
    into ``.grad`` in the parameter dtype, one rounding per chunk) or 'float32' (bf16/fp16 parameters: a float32
    sum rounded into ``.grad`` once per step, as full-sequence training rounds once; 4 bytes per such parameter
    during the step instead of 2). Measured on a tiny bf16 model: with 128 chunks the worst gradient error was
    2.90x the full-sequence bf16 error with 'param' (see :mod:`oomb.engine.grad_accum`)."""

    def __post_init__(self) -> None:
        for name in ("chunk_size", "page_size", "loss_chunk_size", "attention_block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer number of tokens, got {value!r}")
        if self.chunk_size % self.page_size != 0:
            raise ValueError(
                f"chunk_size ({self.chunk_size}) must be a multiple of page_size ({self.page_size}) so that "
                f"chunks never share a page; pick e.g. chunk_size={max(1, round(self.chunk_size / self.page_size)) * self.page_size}"
            )
        if self.attention_backend not in _BACKENDS:
            raise ValueError(f"attention_backend must be one of {_BACKENDS}, got {self.attention_backend!r}")
        if isinstance(self.offload, str) and self.offload in ("on", "off"):
            self.offload = self.offload == "on"
        if self.offload not in (True, False, "auto") or isinstance(self.offload, int) and not isinstance(self.offload, bool):
            raise ValueError(f"offload must be True, False or 'auto' ('on'/'off'), got {self.offload!r}")
        if self.gpu_page_budget is not None:
            b = self.gpu_page_budget
            if not isinstance(b, int) or isinstance(b, bool) or b <= 0:
                raise ValueError(f"gpu_page_budget must be a positive number of pages or None, got {b!r}")
            if self.offload is False:
                raise ValueError("gpu_page_budget sizes the GPU tier of offload; it cannot be set with offload=False")
        if self.offload_staging_sets is not None:
            k = self.offload_staging_sets
            if not isinstance(k, int) or isinstance(k, bool) or k < 2:
                raise ValueError(f"offload_staging_sets must be an integer >= 2 or None, got {k!r}")
            if self.offload is False:
                raise ValueError("offload_staging_sets sizes the staging of offload; it cannot be set with offload=False")
            if not self.sparse:
                raise ValueError("offload_staging_sets sizes whole-layer staging, which only sparse attention uses "
                                 "(dense offload stages segments: see offload_segment_pages); set sparse=True or "
                                 "leave it None")
        if self.offload_segment_pages is not None:
            sp = self.offload_segment_pages
            if not isinstance(sp, int) or isinstance(sp, bool) or sp <= 0:
                raise ValueError(f"offload_segment_pages must be a positive number of pages or None, got {sp!r}")
            if self.offload is False:
                raise ValueError("offload_segment_pages sizes the staging of offload; it cannot be set with offload=False")
        if not isinstance(self.sparse, bool):
            raise ValueError(f"sparse must be True or False, got {self.sparse!r}")
        for name in ("page_budget", "sink_pages", "local_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer number of pages, got {value!r}")
        if not isinstance(self.sparse_block_size, int) or isinstance(self.sparse_block_size, bool) or self.sparse_block_size <= 0:
            raise ValueError(f"sparse_block_size must be a positive integer number of queries, got {self.sparse_block_size!r}")
        if self.sparse_score not in ("mean", "quest"):
            raise ValueError(f"sparse_score must be 'mean' or 'quest', got {self.sparse_score!r}")
        if not self.sparse:  # as the CLI's _check_sparse_flags: an option that would be silently ignored
            given = {k: getattr(self, k) for k, v in SPARSE_DEFAULTS.items() if getattr(self, k) != v}
            if given:
                one = len(given) == 1
                raise ValueError(
                    f"{' and '.join(f'{k}={v!r}' for k, v in given.items())} {'sets' if one else 'set'} sparse "
                    f"attention but sparse is False, so {'it' if one else 'they'} would be ignored; pass sparse=True, "
                    f"or leave {'it' if one else 'them'} at the default "
                    f"({', '.join(f'{k}={SPARSE_DEFAULTS[k]!r}' for k in given)}) for dense attention"
                )
        if self.save_attention not in ("off", "gpu", "host"):
            raise ValueError(f"save_attention must be 'off', 'gpu' or 'host', got {self.save_attention!r}")
        if self.grad_accum_dtype not in ("param", "float32"):
            raise ValueError(f"grad_accum_dtype must be 'param' or 'float32', got {self.grad_accum_dtype!r}")
        if self.attention_block_size % self.page_size != 0:
            # Round up so reference blocks are whole pages.
            self.attention_block_size = -(-self.attention_block_size // self.page_size) * self.page_size

    def dense(self) -> "OOMBConfig":
        """This configuration with dense attention: ``sparse`` off and the sparse options at their defaults
        (which ``sparse=False`` requires)."""
        return replace(self, sparse=False, **SPARSE_DEFAULTS)
