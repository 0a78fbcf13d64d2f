"""Whole-layer staging (docs/design.md §2.3, "Schedule, whole-layer"): a layer's past is staged into staging set
``layer % K`` for its attention view, prefetched one use ahead; in Stage 2 a sparse selection narrows the copies
to the pages it reads (page grain) or hands them to :mod:`.head_tiles` (tile grain)."""

from __future__ import annotations

import bisect

import torch

from .uses import _HeadsOf, _Tag, _Use, _coalesce_runs, _covers, _page_runs


class _WholeLayerStaging:
    """Staging, prefetch and write-back of whole layers for :class:`~oomb.engine.offload.OffloadedKVStore` (a mixin:
    the store holds the pools, the streams, the events and the per-step state that :meth:`reset` makes)."""

    def _set(self, layer: int) -> int:
        return layer % self.staging_sets

    def _satisfied(self, use: _Use) -> tuple[bool, bool]:
        """(K/V present, dK/dV present) for ``use`` in its staging set (trivially so when all resident)."""
        R = self.resident_pages_per_layer
        tag = self._tag[self._set(use.layer)]
        kv_here = (tag is not None and tag.layer == use.layer and tag.past == use.past and tag.kv
                   and _covers(tag.pages, use.pages))
        kv_ok = use.past <= R or kv_here or use.pages == ()  # (): a Stage-1 past all resident or in the shadow
        grad_ok = (
            not use.grad
            or use.past + use.own <= R
            or (kv_here and tag.grad_start == use.start and tag.grad_own == use.own
                and _covers(tag.grad_pages, use.pages))
        )
        return kv_ok, grad_ok

    def _stage(self, use: _Use, why: str) -> None:
        """Copy what ``use`` lacks into staging set ``layer % K`` (side stream)."""
        kv_ok, grad_ok = self._satisfied(use)
        if kv_ok and grad_ok:
            return
        s = self._set(use.layer)
        if self._busy[s] and self._owner[s] != use.layer:
            raise RuntimeError(
                f"staging set {s} is in use by layer {self._owner[s]} while layer {use.layer} needs it: "
                "attention_view/after_attention_forward/after_backward were called out of the engine's order"
            )
        R, W, L = self.resident_pages_per_layer, self.staging_pages, self.num_layers
        base = L * R + s * W
        layer = use.layer
        tag = self._tag[s]
        # Readers of the set are done at _free[s]; a set still held by this same layer (an upgrade
        # to K/V + dK/dV) waits for everything enqueued so far instead.
        st = self._streams
        st.copy_wait(st.record_compute() if self._busy[s] else self._free[s])
        self._after_host_writes(layer)
        if isinstance(use.pages, _HeadsOf):
            self._stage_heads(use, s, base, kv_ok, grad_ok)
            tag = self._tag[s] if kv_ok else _Tag(layer, use.past, kv=True, pages=use.pages)
            if not grad_ok:
                tag.grad_start, tag.grad_own, tag.grad_pages = use.start, use.own, use.pages
            kv_ok = grad_ok = True
        if not kv_ok:
            # Pages keep their slots (base + p - R) either way: only the copies differ.
            for a, e in ((R, use.past),) if use.pages is None else use.pages:
                st.copy_(self.k_cache[base + a - R : base + e - R], self.k_host[layer, a - R : e - R])
                st.copy_(self.v_cache[base + a - R : base + e - R], self.v_host[layer, a - R : e - R])
                self._stats["h2d_bytes"] += 2 * self.k_host[layer, a - R : e - R].numel() * self.k_host.element_size()
            tag = _Tag(layer, use.past, kv=True, pages=use.pages)
        if not grad_ok:
            # dK/dV of the past pages read (all, or the needed runs) and of the chunk's own pages beyond R.
            # Only these slots are read by a write-back out of the set: the K/V copies above may run
            # while the previous layer's write-back is still in flight; each dK/dV copy below waits
            # for the write-back piece(s) out of its slots.
            if self._wb_prev[s] is not None:
                st.copy_wait(self._wb_prev[s])
            end = use.past + use.own
            if use.pages is None:
                spans = [(R, end)]
            else:
                spans = list(use.pages)
                own_lo = max(use.past, R)
                if end > own_lo:
                    if spans and spans[-1][1] == own_lo:
                        spans[-1] = (spans[-1][0], end)
                    else:
                        spans.append((own_lo, end))
            heads_used = self._heads_used[layer]
            for a, e in spans:
                # After a head-grained write-back into this layer, page-level validity no longer tells which
                # tiles hold a gradient: copy the span, then zero the never-written tiles (below).
                for x0, y0, ok in ((a, e, True),) if heads_used else self._valid_runs(layer, a, e):
                    for x, y, piece in self._writeback_split(s, x0 - R, y0 - R):  # slot offsets
                        self._after_writeback_piece(s, piece)
                        if ok:
                            st.copy_(self.dk_cache[base + x : base + y], self.dk_host[layer, x:y])
                            st.copy_(self.dv_cache[base + x : base + y], self.dv_host[layer, x:y])
                            self._stats["h2d_bytes"] += 2 * self.dk_host[layer, x:y].numel() * self.dk_host.element_size()
                        else:  # never written back: zero on the device instead of copying
                            st.zero_(self.dk_cache[base + x : base + y])
                            st.zero_(self.dv_cache[base + x : base + y])
                if heads_used:
                    self._zero_unwritten(layer, base, a - R, e - R)
            if tag is None or tag.layer != layer or tag.past != use.past:
                tag = _Tag(layer, use.past, kv=use.past <= R or use.pages == (), pages=use.pages)
            tag.grad_start, tag.grad_own, tag.grad_pages = use.start, use.own, use.pages
        st.record_copy(self._ready[s])
        self._tag[s] = tag
        self._stats[why] += 1
        if self.trace is not None:
            self.trace.append(("stage", why, layer, use.start, use.past, use.own if use.grad else None))

    def _zero_unwritten(self, layer: int, base: int, x: int, y: int) -> None:
        """Zero the staged dK/dV tiles of host pages [x, y) (offsets from R; slots base + x..) never written back."""
        dk, dv, written = self.dk_cache, self.dv_cache, self._written

        def run():
            keep = written[layer, x:y][:, None, :, None]  # [n, 1, Hkv, 1]
            zero = torch.zeros((), dtype=dk.dtype, device=dk.device)
            dk[base + x : base + y] = torch.where(keep, dk[base + x : base + y], zero)
            dv[base + x : base + y] = torch.where(keep, dv[base + x : base + y], zero)

        self._streams.h2d_run(run)

    def _valid_runs(self, layer: int, a: int, e: int) -> list[tuple[int, int, bool]]:
        """Pages [a, e) (>= R) of ``layer`` split into runs ``(x, y, written)``: whether their host dK/dV
        hold a written-back gradient (else the staging zero-fills them)."""
        gv = max(self._grad_valid[layer], a)
        out: list[tuple[int, int, bool]] = []
        if gv > a:
            out.append((a, min(gv, e), True))
        extra = self._grad_extra[layer]
        if not extra:
            if e > gv:
                out.append((gv, e, False))
            return out
        for p in range(gv, e):
            ok = p in extra
            if out and out[-1][2] == ok and out[-1][1] == p:
                out[-1] = (out[-1][0], p + 1, ok)
            else:
                out.append((p, p + 1, ok))
        return out

    def _mark_written(self, layer: int, runs) -> None:
        """Host dK/dV of the pages of ``runs`` ([a, e), >= R) now hold a written-back gradient."""
        R = self.resident_pages_per_layer
        gv = max(self._grad_valid[layer], R)
        extra = self._grad_extra[layer]
        for a, e in runs:
            if e <= gv:
                continue
            if a <= gv:
                gv = e
            else:
                extra.update(range(a, e))
        while gv in extra:
            extra.discard(gv)
            gv += 1
        if extra:
            extra.difference_update([p for p in extra if p < gv])
        if gv > max(self._grad_valid[layer], R):
            self._grad_valid[layer] = gv

    def _stage2_use(self, layer: int, start: int, past: int, own: int, grad: bool) -> _Use:
        """A Stage-2 use; its ``pages`` are the selection's tiles (:class:`_HeadsOf`, head grain with a
        ``needed_heads`` hook that knows them), else the host pages the ``needed_pages`` hook names (None: all)."""
        if (self.stage_grain == "head" and self.needed_heads is not None and past > self.resident_pages_per_layer
                and self.needed_heads(layer, start) is not None):
            return _Use(layer, start, past, own, grad, _HeadsOf(start, own))
        return _Use(layer, start, past, own, grad, self._needed_runs(layer, start, past))

    def _needed_runs(self, layer: int, start: int, past: int) -> tuple[tuple[int, int], ...] | None:
        """Runs of the host pages [R, past) the attention of (``layer``, chunk at ``start``) reads (None: all)."""
        R = self.resident_pages_per_layer
        if self.needed_pages is None or past <= R:
            return None
        key = (layer, start)
        if key not in self._runs_cache:
            pages = self.needed_pages(layer, start)
            if pages is not None:
                runs = _page_runs(pages[bisect.bisect_left(pages, R) : bisect.bisect_left(pages, past)])
                pages = _coalesce_runs(runs, R, past, self.stage_merge_gap_pages, self.stage_whole_fraction,
                                       self.stage_max_runs)
            self._runs_cache[key] = pages
        return self._runs_cache[key]

    def _wait_staged(self, use: _Use, ev) -> None:
        # The compute stream waits for the copies into a staging set (a test removes it to show the simulator notices).
        self._streams.compute_wait(ev)

    def _acquire(self, use: _Use) -> None:
        """Make ``use``'s pages ready for the compute stream (staging now what was not prefetched)."""
        if self._pending == use:
            self._pending = None
        self._stage(use, "on_demand")
        s = self._set(use.layer)
        self._wait_staged(use, self._ready[s])
        self._busy[s] = True
        self._owner[s] = use.layer
        self._inflight[use.layer] = use

    def _release(self, layer: int, ev) -> None:
        s = self._set(layer)
        self._free[s] = ev
        self._busy[s] = False
        self._inflight.pop(layer, None)
        if self._pending is not None and not self._busy[self._set(self._pending.layer)]:
            use, self._pending = self._pending, None
            self._stage(use, "prefetched")

    def _prefetch(self, use: _Use | None) -> None:
        if use is None:
            return
        if self._busy[self._set(use.layer)]:
            self._pending = use  # staged as soon as that set's current use ends
        else:
            self._stage(use, "prefetched")

    def _next_chunk_forward(self, start: int, stage2: bool) -> _Use | None:
        """Layer 0's K/V use of the chunk at token ``start`` (None past the sequence)."""
        if start < 0 or (self._seq_len is not None and start >= self._seq_len):
            return None
        if stage2:
            return self._stage2_use(0, start, start // self.page_size, 0, False)
        if self._seq_len is not None and start + self.chunk_size >= self._seq_len:
            return _Use(0, start, start // self.page_size, 0, False)  # the last chunk: its first use is Stage 2's
        return self._stage1_use(0, start, start // self.page_size)

    def _stage1_use(self, layer: int, start: int, past: int) -> _Use:
        """A Stage-1 (K/V only) use: with the shadow, only the host pages beyond it ([R + Sh, past); () if none)."""
        Sh = self.stage1_shadow_pages
        if not Sh or self._in_stage2:
            return _Use(layer, start, past, 0, False)
        lo = self.resident_pages_per_layer + Sh
        return _Use(layer, start, past, 0, False, ((lo, past),) if past > lo else ())

    def _begin_stage2(self) -> None:
        """The step's first Stage-2 view: with the shadow, every dK/dV page is zeroed now (Stage 1 used their
        bytes for K/V; this also clears the resident pages' gradients, which Stage-1 writes then leave alone)."""
        self._in_stage2 = True
        if self.stage1_shadow_pages:
            self.dk_cache.zero_()
            self.dv_cache.zero_()
            self._streams.copy_wait(self._streams.record_compute())  # before any staging into dK/dV slots

    def _next_backward(self, use: _Use) -> _Use | None:
        """The use after the backward of ``use.layer``: the next lower layer's backward, or chunk c-1's forward."""
        if use.layer > 0:
            return self._stage2_use(use.layer - 1, use.start, use.past, use.own, True)
        return self._next_chunk_forward(use.start - self.chunk_size, True) if use.start > 0 else None

    def _after_backward(self, use: _Use) -> None:
        """Write the layer's updated past dK/dV back to the host; ready the next layer's backward."""
        R, W, L = self.resident_pages_per_layer, self.staging_pages, self.num_layers
        s = self._set(use.layer)
        st = self._streams
        done = st.record_compute()  # the backward kernels of this layer are enqueued before this point
        m = use.past - R
        if m > 0 and use.pages is None:
            base = L * R + s * W
            st.d2h_wait(done)
            self._write_back_pieces(s, use.layer, base, [(0, m)])
            self._grad_valid[use.layer] = max(self._grad_valid[use.layer], use.past)
            if self._grad_extra[use.layer]:
                self._mark_written(use.layer, ())
            if self.trace is not None:
                self.trace.append(("writeback", use.layer, use.start, use.past))
        elif m > 0 and isinstance(use.pages, _HeadsOf):  # only the tiles the backward wrote
            st.d2h_wait(done)
            self._write_back_heads(use, s, L * R + s * W)
            if self.trace is not None:
                self.trace.append(("writeback", use.layer, use.start, use.past))
        elif m > 0 and use.pages:  # only the pages the backward wrote (the selected ones): the rest are untouched
            base = L * R + s * W
            st.d2h_wait(done)
            self._write_back_pieces(s, use.layer, base, [(a - R, e - R) for a, e in use.pages])
            self._mark_written(use.layer, use.pages)
            if self.trace is not None:
                self.trace.append(("writeback", use.layer, use.start, use.past))
        self._release(use.layer, done)
        nxt = self._next_backward(use)
        if nxt is not None and nxt.grad:
            self._acquire(nxt)  # its backward comes next: the compute stream waits for its pages here
            self._prefetch(self._next_backward(nxt))
        else:
            self._prefetch(nxt)
