"""Tile-grain staging (docs/design.md §2.3, "only the selected (page, KV head) tiles"): a Stage-2 use of a sparse
(chunk, layer) moves only the tiles its selection reads, with the zero-copy Triton kernels of
:mod:`oomb.ops.page_gather` on the copy streams, and the K/V stash keeps a forward's tiles for that layer's
backward."""

from __future__ import annotations

import torch

from ...ops.page_gather import (
    gather_head_pages,
    head_pairs,
    scatter_head_pages,
    stash_head_tiles,
    unstash_head_tiles,
)
from .uses import _Use


def _zero_copy_works(host: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether the tile kernels can address the pinned host tier from the GPU (a launch with no tiles; Triton
    checks every pointer argument). False on systems without unified addressing of page-locked memory."""
    try:
        pairs = torch.zeros(2, dtype=torch.int32, device=pool.device)
        gather_head_pages(pool, 0, host[0, :1], pairs, pairs[:1], backend="triton")
        return True
    except (ValueError, RuntimeError):
        return False


def copy_kernel_args(programs: int, warps: int | None, elems: int | None) -> dict:
    """Launch keywords of the tile copy kernels: ``num_programs``, and ``num_warps`` / ``elems_per_load`` where
    set (None: the kernel's defaults)."""
    args = {"num_programs": programs}
    if warps is not None:
        args["num_warps"] = warps
    if elems is not None:
        args["elems_per_load"] = elems
    return args


class _HeadTileStaging:
    """Tile lists, tile stagings and tile write-backs of :class:`~oomb.engine.offload.OffloadedKVStore` (a mixin)."""

    def _tile_copy(self, kernel, *args, **kwargs) -> None:
        """Launch the copy kernel ``kernel`` (of :mod:`oomb.ops.page_gather`) with this store's launch settings
        (:func:`copy_kernel_args` of its ``page_gather_*`` arguments)."""
        kernel(*args, **kwargs, **self._copy_kernel_args)

    def _head_tiles(self, use: _Use) -> tuple:
        """(pairs, count_all, count_kv, mask, made) of a head-grained use, made on the host->device stream once
        per (layer, chunk): ``mask`` [past + own - R, Hkv] bool marks the host tiles the selection reads (all
        heads of the own pages), ``pairs[:count_all]`` lists them (:func:`~oomb.ops.page_gather.head_pairs`),
        the first ``count_kv`` being past pages'; ``made``: an event on that stream after they are written."""
        key = (use.layer, use.start, use.pages.own)
        hit = self._pairs_cache.get(key)
        if hit is not None:
            return hit
        R, Hkv = self.resident_pages_per_layer, self.num_kv_heads
        past, own = use.past, use.pages.own
        page_idx = self.needed_heads(use.layer, use.start)
        n = past + own - R
        dev = self.device
        t: dict = {}
        # Allocated on the host->device stream (its kernels fill them; the device->host stream reads them).
        self._streams.h2d_alloc(lambda: t.update(
            full=torch.empty((past + own, Hkv), dtype=torch.bool, device=dev),
            pairs=torch.empty(n * Hkv + 1, dtype=torch.int32, device=dev),
            count_all=torch.empty(1, dtype=torch.int32, device=dev),
            count_kv=torch.empty(1, dtype=torch.int32, device=dev),
        ))
        full, pairs, count_all, count_kv = t["full"], t["pairs"], t["count_all"], t["count_kv"]
        st = self._streams
        if self._seq_len is not None and use.start + self.chunk_size >= self._seq_len:
            # The last chunk's selection is made in Stage 2, just before this (compute stream): read it after.
            st.copy_wait(st.record_compute())

        st.h2d_keep(page_idx)  # made on the compute stream, read below on the copy stream

        def run():
            full.zero_()
            idx = page_idx.clamp(min=0).long()  # padding reads page 0 (the reference gathers it, then masks it)
            heads = torch.arange(Hkv, device=dev)[None, :, None].expand_as(idx)
            full[idx, heads] = True
            full[past:] = True
            head_pairs(full[R:], out=(pairs, count_all))
            count_kv.copy_(full[R:past].sum(dtype=torch.int32).reshape(1))

        st.h2d_run(run)
        # The list is made on the host->device stream; a write-back (device->host stream) that is the first to
        # need it (its staging found the tiles already there, e.g. in a whole-layer staging) waits for this.
        made = st.event()
        st.record_copy(made)
        hit = self._pairs_cache[key] = (pairs, count_all, count_kv, full[R:], made)
        return hit

    def _stage_heads(self, use: _Use, s: int, base: int, kv_ok: bool, grad_ok: bool) -> None:
        """Stage the tiles of a head-grained use (K/V of its past tiles; dK/dV of those and of its own pages)."""
        st = self._streams
        layer, m = use.layer, use.past - self.resident_pages_per_layer
        o = use.pages.own
        pairs, count_all, count_kv, _, _ = self._head_tiles(use)
        tile = self.page_size * self.head_dim
        kc, vc, kh, vh = self.k_cache, self.v_cache, self.k_host[layer], self.v_host[layer]
        dkc, dvc, dkh, dvh = self.dk_cache, self.dv_cache, self.dk_host[layer], self.dv_host[layer]
        counter, copy = self._dev_bytes, self._tile_copy
        if not kv_ok:
            # The K/V stash: a Stage-2 forward use of a layer below L - K keeps its first C tiles, which that
            # layer's backward use of the same chunk takes back instead of reading them over PCIe. Both lists
            # begin with the same past tiles (ascending; the backward's own-page tiles come after them).
            C = self.kv_stash_tiles if layer < self.num_layers - self.staging_sets else 0
            key = use.start
            restore = C and use.grad and self._stash_key[layer] == key
            keep = C and not use.grad
            sk = self._stash_k[layer] if C else None
            sv = self._stash_v[layer] if C else None
            tile_bytes = 2 * tile * kh.element_size()

            def kv():
                first = 0
                if restore:
                    copy(unstash_head_tiles, kc, base, m, sk, pairs, count_kv)
                    copy(unstash_head_tiles, vc, base, m, sv, pairs, count_kv)
                    first = C
                    counter[2] += count_kv[0].long().clamp(max=C) * tile_bytes
                copy(gather_head_pages, kc, base, kh[:m], pairs, count_kv, first=first)
                copy(gather_head_pages, vc, base, vh[:m], pairs, count_kv, first=first)
                counter[0] += (count_kv[0].long() - first).clamp(min=0) * tile_bytes
                if keep:
                    copy(stash_head_tiles, sk, kc, base, m, pairs, count_kv)
                    copy(stash_head_tiles, sv, vc, base, m, pairs, count_kv)

            st.h2d_run(kv)
            if C:
                self._stash_key[layer] = key if keep else None
        if not grad_ok:
            if self._wb_prev[s] is not None:
                st.copy_wait(self._wb_prev[s])
            valid = self._written[layer, : m + o]
            # The dK/dV slots are read by the last write-back out of this set, in pieces (slot ranges with an
            # event each): pages outside every piece (gaps, the tail) are gathered first, with no wait, then each
            # piece's after its event, so this staging follows the write-back instead of waiting for all of it.
            free, waits, x = [], [], 0
            for lo, hi, ev in self._wb_pieces[s]:
                if lo > x:
                    free.append((x, lo, None))
                waits.append((lo, hi, ev))
                x = max(x, hi)
            free.append((x, m + o, None))
            for lo, hi, ev in free + waits:
                if hi <= lo or lo >= m + o:
                    continue
                if ev is not None:
                    st.copy_wait(ev)

                def grad(lo=lo, hi=hi):
                    copy(gather_head_pages, dkc, base, dkh[: m + o], pairs, count_all, valid, pages=(lo, hi))
                    copy(gather_head_pages, dvc, base, dvh[: m + o], pairs, count_all, valid, pages=(lo, hi))

                st.h2d_run(grad)
            st.h2d_run(lambda: counter.__setitem__(0, counter[0] + count_all[0].long() * (2 * tile * dkh.element_size())))

    def _write_back_heads(self, use: _Use, s: int, base: int) -> None:
        """D2H of the past dK/dV tiles a head-grained backward wrote; marks them written (device mask)."""
        st = self._streams
        layer, m = use.layer, use.past - self.resident_pages_per_layer
        pairs, _, count_kv, mask, made = self._head_tiles(use)
        st.d2h_wait(made)
        tile = self.page_size * self.head_dim
        dkc, dvc, dkh, dvh = self.dk_cache, self.dv_cache, self.dk_host[layer], self.dv_host[layer]
        written, counter, copy = self._written, self._dev_bytes, self._tile_copy

        # In pieces of pages with an event each (as whole-layer write-backs): the next staging into this set
        # (two layers down) gathers each piece's slots as soon as that piece is out.
        step = max(1, -(-m // self.writeback_pieces))
        pieces = []
        for lo in range(0, m, step):
            hi = min(m, lo + step)

            def run(lo=lo, hi=hi):
                copy(scatter_head_pages, dkh[:m], dkc, base, pairs, count_kv, pages=(lo, hi))
                copy(scatter_head_pages, dvh[:m], dvc, base, pairs, count_kv, pages=(lo, hi))

            st.d2h_run(run, pairs, count_kv)
            pieces.append((lo, hi, self._d2h_event()))

        def mark():
            written[layer, :m] |= mask[:m]
            counter[1] += count_kv[0].long() * (2 * tile * dkh.element_size())

        st.d2h_run(mark, mask, count_kv)
        self._heads_used[layer] = True
        ev = self._d2h_event()
        pieces[-1] = (pieces[-1][0], pieces[-1][1], ev)
        self._wb_prev[s] = self._wb_buf[s]
        self._wb_pieces[s] = pieces
        self._wb_buf[s] = ev
        self._wb_layer[layer] = ev
        for key in [key for key in self._pairs_cache if key[:2] == (layer, use.start)]:
            del self._pairs_cache[key]
