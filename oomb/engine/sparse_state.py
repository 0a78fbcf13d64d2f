"""The engine's per-step sparse attention state (docs/design.md §2.4): page representatives of every layer and the
selections made in Stage 1 and reused in Stage 2, plus which pages and (page, KV head) tiles each selection reads
(the offload store stages only those)."""

from __future__ import annotations

import torch

from ..ops.attention_ref import acc_dtype_for
from ..ops.paged_attention import step_backend
from ..ops.sparse_representatives import PageRepresentatives
from ..ops.sparse_select import PageSelection, select_pages

__all__ = ["SparseAttentionState"]


class SparseAttentionState:
    """Per-step sparse state of the engine: page representatives and the stored selections.

    Args:
        config: the engine's :class:`oomb.OOMBConfig` (sparse fields).
        num_layers, num_kv_heads, head_dim: model shape.
        seq_len: T in tokens.
        dtype: the model dtype (representatives use its accumulation dtype).
        device: where representatives and selections live.

    Selections are keyed by (chunk start token, layer); the engine drops a chunk's entries once
    its Stage-2 backward is done (``retain_selections=True`` keeps them, for tests and tools).

    Selections are made by :func:`oomb.ops.triton.page_select.select_pages_triton` (one kernel after the scores, no
    host synchronisation) when the sparse attention runs on the Triton kernels on CUDA (``step_backend`` of the
    config is 'triton') with float32 representatives (any model but a float64 one); else by
    :func:`oomb.ops.sparse_select.select_pages`. The two give the same selection, bitwise.
    """

    def __init__(self, config, num_layers, num_kv_heads, head_dim, seq_len, dtype, device, retain_selections=False):
        self.config = config
        self.reps = PageRepresentatives(
            num_layers, num_kv_heads, head_dim, -(-seq_len // config.page_size), config.page_size,
            config.sparse.score, acc_dtype_for(dtype), device,
        )
        self.selections: dict[tuple[int, int], PageSelection] = {}
        self.retain_selections = retain_selections
        self.page_size = config.page_size
        self.track_pages = False
        self.track_last = False  # the engine notes the last chunk's selections too (head-grained offload: note_tiles)
        # (start, layer) -> [host bool mask of the past pages read, its copy event (CUDA) or None, or the list]
        self._pages: dict[tuple[int, int], list] = {}
        self._pages_host: dict[int, torch.Tensor] = {}  # chunk start -> pinned [num_layers, n_past] bool (CUDA)
        self._num_layers = num_layers
        self._select = select_pages
        if (torch.device(device).type == "cuda" and step_backend(config, torch.device(device)) == "triton"
                and acc_dtype_for(dtype) == torch.float32):
            from ..ops.triton.page_select import select_pages_triton

            self._select = select_pages_triton

    def write(self, layer: int, start: int, k: torch.Tensor) -> None:
        """Stage 1: summarise the chunk's keys [n, Hkv, D] (after the store wrote them)."""
        self.reps.write(layer, start, k)

    def selection(
        self, layer: int, start: int, q: torch.Tensor, q_doc_start: torch.Tensor | None, record_pages: bool = False
    ) -> PageSelection:
        """The stored selection of (chunk at ``start``, ``layer``); made from ``q`` the first time.

        Made in Stage 1 for every chunk but the last, whose Stage-1 pass the engine skips; that
        one is made in its first Stage-2 forward and reused by any recompute. With
        ``record_pages`` (the engine passes it in Stage 1) and :attr:`track_pages` set, a new
        selection's page union is recorded for :meth:`needed_pages`.
        """
        key = (start, layer)
        sel = self.selections.get(key)
        if sel is None:
            cfg, sp = self.config, self.config.sparse
            n = -(-start // cfg.page_size)
            with torch.no_grad():
                sel = self._select(
                    q, self.reps.layer(layer, n), start, cfg.page_size, sp.page_budget, sp.sink_pages,
                    sp.local_pages, sp.block_size, sp.score, q_doc_start,
                )
            self.selections[key] = sel
            if record_pages and self.track_pages:
                self._record_pages(layer, start, sel)
        return sel

    def _record_pages(self, layer: int, start: int, sel: PageSelection) -> None:
        """Start copying the union of the past pages ``sel``'s attention reads to the host (no sync).

        The union is a bool mask over the ``n`` past pages, of a fixed size, so nothing on the host
        waits for it to be computed (``torch.unique`` would: its size is data-dependent). It holds
        every page of ``sel.page_idx`` (all heads and blocks), the sink and local pages included (they
        are part of it), and logical page 0 where a row is padded with -1: the PyTorch reference
        gathers padding entries from page 0 (then masks them), so page 0 must hold finite values.
        A dense selection (attention takes the dense path, reading every past page) marks every page.
        On CUDA the mask goes into a pinned [num_layers, n] buffer of the chunk with a non-blocking
        copy and an event; :meth:`needed_pages` waits for that event only.
        """
        n = -(-start // self.page_size)
        device = sel.page_idx.device
        if n == 0:
            self._pages[(start, layer)] = [[]]
            return
        with torch.no_grad():
            mask = torch.zeros(n, dtype=torch.bool, device=device)
            if n and sel.dense:
                mask.fill_(True)
            elif n and sel.page_idx.numel():
                mask[sel.page_idx.clamp(min=0).long().flatten()] = True
        if device.type != "cuda":
            self._pages[(start, layer)] = [mask, None]
            return
        buf = self._pages_host.get(start)
        if buf is None:
            buf = self._pages_host[start] = torch.empty((self._num_layers, n), dtype=torch.bool, pin_memory=True)
        buf[layer].copy_(mask, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        self._pages[(start, layer)] = [buf[layer], ev]

    def note_tiles(self, layer: int, start: int) -> None:
        """Let :meth:`needed_heads` give the store the selection of (chunk at ``start``, ``layer``) made in Stage 2
        (the last chunk's, with :attr:`track_last`). Its page union is not recorded: :meth:`needed_pages` stays
        None (all pages) for it, with no copy to the host and no wait on the device."""
        if self.track_pages and (start, layer) not in self._pages:
            self._pages[(start, layer)] = [None]

    def needed_pages(self, layer: int, start: int) -> list[int] | None:
        """Sorted logical past pages the attention of (chunk at ``start``, ``layer``) reads; None if unknown.

        Known for selections made in Stage 1 while :attr:`track_pages` is set (the engine sets it
        for an offloaded store with whole-layer staging, which stages only these pages in Stage 2);
        None otherwise, e.g. for the last chunk, whose selection is made in Stage 2. Never syncs the
        device: it waits only on the event of the Stage-1 copy of this mask (long done by Stage 2).
        """
        entry = self._pages.get((start, layer))
        if entry is None:
            return None
        if len(entry) == 1:
            return entry[0]
        mask, ev = entry
        if ev is not None:
            ev.synchronize()
        pages = torch.nonzero(mask).flatten().tolist()
        self._pages[(start, layer)] = [pages]
        return pages

    def needed_heads(self, layer: int, start: int) -> torch.Tensor | None:
        """int32 ``page_idx`` [nb, Hkv, K] (device, -1 padded) of the selection of (chunk at ``start``,
        ``layer``): the (page, KV head) tiles its attention reads; None if unknown or dense.

        Known, like :meth:`needed_pages`, for selections made in Stage 1 while :attr:`track_pages` is set, and
        for the last chunk's (made in its Stage-2 forward, before the store's view of that layer) once the engine
        has called :meth:`note_tiles` (:attr:`track_last`). Never syncs: the offload store turns it into a tile
        list on its copy stream.
        """
        if (start, layer) not in self._pages:
            return None
        sel = self.selections.get((start, layer))
        if sel is None or sel.dense:
            return None
        return sel.page_idx

    def release(self, start: int) -> None:
        """Forget the selections (and recorded page unions) of the chunk at ``start`` (unless retaining)."""
        if not self.retain_selections:
            for key in [key for key in self.selections if key[0] == start]:
                del self.selections[key]
            for key in [key for key in self._pages if key[0] == start]:
                del self._pages[key]
            self._pages_host.pop(start, None)
