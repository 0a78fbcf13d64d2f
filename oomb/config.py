"""Typed configuration of the chunk-recurrent engine."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OOMBConfig"]

_BACKENDS = ("auto", "torch", "triton")


@dataclass
class OOMBConfig:
    """Settings of one chunk-recurrent training step (DESIGN.md §2.1–2.2).

    Raises:
        ValueError: on a non-positive size, a chunk size that is not a multiple
            of the page size, or an unknown attention backend. The message names
            the field and the fix.
    """

    chunk_size: int = 4096
    """Tokens per chunk. Activation memory scales with this, not with the sequence length."""

    page_size: int = 128
    """Tokens per KV page (one layer, all KV heads). `chunk_size` must be a multiple of it."""

    attention_backend: str = "auto"
    """'torch' (PyTorch reference), 'triton' (kernels) or 'auto' (triton on CUDA when importable, else torch)."""

    checkpoint_layers: bool = False
    """Per-layer activation checkpointing inside each chunk's Stage-2 recompute."""

    loss_chunk_size: int = 1024
    """Tokens per logits block in the chunked cross-entropy; logits exist for at most this many tokens."""

    attention_block_size: int = 4096
    """Past tokens per block in the memory-bounded PyTorch reference attention."""

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
        if self.attention_block_size % self.page_size != 0:
            # Round up so reference blocks are whole pages.
            self.attention_block_size = -(-self.attention_block_size // self.page_size) * self.page_size
