"""What one (chunk, layer) attention call of a training step does in each stage (docs/design.md §2.1).

The engine hands a :class:`ChunkContext` to the model's attention (through transformers' kwargs, see
:func:`oomb.models.hf.use_oomb_attention`) for every chunk it runs: Stage 1 writes the chunk's K/V to the page
store and attends without autograd; Stage 2 attends with autograd, reusing Stage 1's outputs where they were saved
(``save_attention``) or the chunk's first forward's across a layer checkpoint (``checkpoint_attention``); a
Stage-1 chunk that keeps its graph (``keep_graphs``) writes as Stage 1 and attends as Stage 2.
"""

from __future__ import annotations

import torch

from ..config import OOMBConfig
from ..ops.paged_attention import paged_attention, paged_attention_forward, paged_backend
from ..ops.sparse_attention import sparse_paged_attention, sparse_paged_attention_forward

__all__ = ["ChunkContext"]


class ChunkContext:
    """Per-(stage, chunk) state handed to the attention function through transformers' kwargs."""

    def __init__(
        self, engine, stage: int, start: int, length: int, is_last: bool, q_doc_start: torch.Tensor | None,
        keep_graph: bool = False,
    ):
        self.engine = engine
        self.stage = stage
        self.start = start
        self.length = length
        self.is_last = is_last
        self.q_doc_start = q_doc_start
        # A Stage-1 chunk whose forward runs with autograd and keeps its graph for its Stage-2 backward (keep_graphs):
        # it writes its K/V as Stage 1 does and attends as Stage 2 does.
        self.keep_graph = keep_graph

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
        """query [1, Hq, C, D], key/value [1, Hkv, C, D] -> attention output [1, C, Hq, D]."""
        eng = self.engine
        store = eng._store
        q = query[0].transpose(0, 1)
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
        sparse = eng._sparse
        sel = None
        if sparse is not None:
            # Made once (Stage 1, or the last chunk's first Stage-2 forward) and reused unchanged; before the view,
            # so that the store knows which tiles the last chunk's attention reads (SparseAttentionState.track_last).
            sel = sparse.selection(layer, self.start, q, self.q_doc_start, record_pages=self.stage == 1)
            if self.is_last and sparse.track_last:
                sparse.note_tiles(layer, self.start)
        keep = self.keep_graph
        # A kept graph's view is Stage 2's: its backward writes the past's dK/dV and reads what later chunks stored
        # in its own pages (the block table is read then, after the write below allocates them).
        kv = store.attention_view(layer, 2 if keep else self.stage, self.start, self.length, self.is_last,
                                  self.q_doc_start)
        if self.stage == 1:
            store.write(layer, self.start, k.detach(), v.detach())
            if sparse is not None:
                sparse.write(layer, self.start, k)
        saved, kept = eng._saved, eng._kept
        chunk = self.start // eng.config.chunk_size
        # Stage 2 of a chunk Stage 1 ran: its attention outputs, if they were kept (save_attention); else, in the
        # rerun of a checkpointed layer, those of the chunk's first forward (checkpoint_attention='keep').
        prev = saved.load(chunk, layer) if saved is not None and self.stage == 2 and not self.is_last else None
        if prev is None and kept is not None and self.stage == 2:
            prev = kept.take(self.start, layer)
        backend = eng._backend if sparse is None else paged_backend(eng._backend, q.device)  # sparse: block tables
        call = (q, k, v, kv, sel, scaling, backend, eng.config)
        if (self.stage == 1 and not keep) or (prev is None and kept is not None):  # outside autograd: out and lse
            out, lse = _attention_forward(*call)
            if self.stage == 2:
                kept.keep(self.start, layer, out, lse)
                prev = (out, lse)
        if self.stage == 2 or keep:
            out = _attention_with_grad(*call, prev)
        elif saved is not None:
            saved.save(chunk, layer, out, lse)
        store.after_attention_forward(layer, self.stage)
        return out.unsqueeze(0)


@torch.no_grad()
def _attention_forward(q, k, v, kv, sel, scaling: float, backend: str, config: OOMBConfig):
    """One (chunk, layer) attention without autograd -> (out [C, Hq, D], lse [Hq, C]); ``sel`` None: dense."""
    bs, kernels = config.attention_block_size, config.kernels
    if sel is not None:
        return sparse_paged_attention_forward(q, k, v, kv, sel, scaling, backend, bs, kernels=kernels)
    return paged_attention_forward(q, k, v, kv, scaling, backend, bs, kernels=kernels)


def _attention_with_grad(q, k, v, kv, sel, scaling: float, backend: str, config: OOMBConfig, saved):
    """One (chunk, layer) attention with autograd -> out [C, Hq, D]; ``saved``: its (out, lse) computed earlier
    on the same inputs (the forward is skipped), or None."""
    bs, kernels = config.attention_block_size, config.kernels
    if sel is not None:
        return sparse_paged_attention(q, k, v, kv, sel, scaling, backend, bs, saved=saved, kernels=kernels)
    return paged_attention(q, k, v, kv, scaling, backend, bs, saved=saved, kernels=kernels)
