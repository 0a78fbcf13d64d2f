"""Segment staging (docs/design.md §2.3, "Segments"): the hooks through which the
:class:`~oomb.memory.schedule.SegmentSchedule` has an offloaded store copy segments and own-gradient pages, and
the :class:`~oomb.ops.paged_attention.PastSegments` that a view hands the attention."""

from __future__ import annotations

import torch

from ...memory.schedule import SegUse


class _SegmentedStaging:
    """The segment schedule's hooks on :class:`~oomb.engine.offload.OffloadedKVStore` (a mixin)."""

    def _slots(self, b: int) -> int:
        return self.num_layers * self.resident_pages_per_layer + b * self.staging_pages

    def stage(self, b: int, use: SegUse, lo: int, hi: int, kv: bool, valid: int | None, why: str) -> None:
        """Copy host pages [lo, hi) of ``use.layer`` into buffer ``b`` (K/V if ``kv``; dK/dV if ``valid`` is
        not None: pages below ``valid`` copied, the rest zero-filled), on the side stream."""
        st, R = self._streams, self.resident_pages_per_layer
        base, m, h = self._slots(b), hi - lo, lo - R
        layer = use.layer
        st.copy_wait(self._free[b])  # kernels that read or wrote the buffer are enqueued before this point
        self._after_host_writes(layer)
        if kv:
            st.copy_(self.k_cache[base : base + m], self.k_host[layer, h : h + m])
            st.copy_(self.v_cache[base : base + m], self.v_host[layer, h : h + m])
            self._stats["h2d_bytes"] += 2 * m * self.k_host[0, 0].numel() * self.k_host.element_size()
        if valid is not None:
            self._after_writeback_out_of(b)
            nv = valid - lo
            if nv:
                st.copy_(self.dk_cache[base : base + nv], self.dk_host[layer, h : h + nv])
                st.copy_(self.dv_cache[base : base + nv], self.dv_host[layer, h : h + nv])
                self._stats["h2d_bytes"] += 2 * nv * self.dk_host[0, 0].numel() * self.dk_host.element_size()
            if m > nv:  # never written back: zero on the device instead of copying
                st.zero_(self.dk_cache[base + nv : base + m])
                st.zero_(self.dv_cache[base + nv : base + m])
        st.record_copy(self._ready[b])
        self._stats[why] += 1
        if self.trace is not None:
            self.trace.append(("stage", why, layer, use.start, use.seg, b, kv, valid is not None))

    def wait(self, b: int) -> None:
        """The compute stream waits for the copies into buffer ``b``."""
        self._wait_segment(self._ready[b])

    def _wait_segment(self, ev) -> None:
        # One place for every compute-side wait on a segment (a test removes it to show the simulator notices).
        self._streams.compute_wait(ev)

    def release(self, b: int, use: SegUse, lo: int, hi: int, writeback: bool) -> None:
        """Readers of buffer ``b`` are enqueued; with ``writeback`` its dK/dV go back to the host (D2H)."""
        st, R = self._streams, self.resident_pages_per_layer
        ev = st.record_compute()
        self._free[b] = ev
        if writeback:
            base, m, h = self._slots(b), hi - lo, lo - R
            st.d2h_wait(ev)  # the backward kernels that added into the buffer
            st.d2h_copy_(self.dk_host[use.layer, h : h + m], self.dk_cache[base : base + m])
            st.d2h_copy_(self.dv_host[use.layer, h : h + m], self.dv_cache[base : base + m])
            self._wrote_back(b, use.layer)
            self._stats["d2h_bytes"] += 2 * m * self.dk_host[0, 0].numel() * self.dk_host.element_size()
            if self.trace is not None:
                self.trace.append(("writeback", use.layer, use.start, use.seg, b))

    def stage_own(self, ob: int, layer: int, lo: int, runs: list, why: str) -> None:
        """Copy the own-gradient host pages (runs of [a, e) pages from ``lo``, valid or zero) into own buffer ``ob``."""
        st, R, O = self._streams, self.resident_pages_per_layer, self.own_pages
        st.copy_wait(self._own_free[ob])
        self._after_host_writes(layer)
        for a, e, ok in runs:
            d0, d1 = ob * O + a - lo, ob * O + e - lo
            if ok:
                st.copy_(self.own_dk_cache[d0:d1], self.dk_host[layer, a - R : e - R])
                st.copy_(self.own_dv_cache[d0:d1], self.dv_host[layer, a - R : e - R])
                self._stats["h2d_bytes"] += 2 * (e - a) * self.dk_host[0, 0].numel() * self.dk_host.element_size()
            else:
                st.zero_(self.own_dk_cache[d0:d1])
                st.zero_(self.own_dv_cache[d0:d1])
        st.record_copy(self._own_ready[ob])
        self._stats[why] += 1
        if self.trace is not None:
            self.trace.append(("stage_own", why, layer, lo, ob))

    def wait_own(self, ob: int) -> None:
        self._wait_segment(self._own_ready[ob])

    def own_read(self, ob: int) -> None:
        self._own_free[ob] = self._streams.record_compute()

    def _segment(self, past: "_SegmentedPast", index: int, grad: bool) -> tuple:
        """(use, buffer, tensors) of segment ``index`` of ``past``, acquired."""
        use = SegUse(past.layer, past.start, index, grad)
        b = self._sched.acquire(use)
        R, SP = self.resident_pages_per_layer, self.segment_pages
        if b is None or index == 0:
            table = self._first_tables[0 if b is None else b, past.layer]
        else:
            off = self.max_pages_per_layer + self._slots(b) - (R + index * SP)
            table = self._ramp[off:]
        grads = (self.dk_cache, self.dv_cache) if grad else (None, None)
        return b, (self.k_cache, self.v_cache, table, *grads)

    def _segment_runs(self, past: _SegmentedPast, index: int, b: int | None, grad: bool) -> tuple[tuple, tuple]:
        """Segment ``index`` of ``past`` (acquired into buffer ``b``; None: all resident) as contiguous views: the
        layer's resident pages ``[l*R, l*R + min(hi, R))`` (segment 0) and the buffer's first pages (the host pages
        it holds, in order), as the tables of :func:`~oomb.engine.offload.layout.segment_tables` address them."""
        R, S, layer = self.resident_pages_per_layer, self.page_size, past.layer
        lo, hi = (t // S for t in past.bounds[index])
        spans = []  # (first slot, pages)
        if index == 0 and min(hi, R):
            spans.append((layer * R, min(hi, R)))
        if hi > max(lo, R):
            spans.append((self._slots(b), hi - max(lo, R)))

        def views(a: torch.Tensor, b: torch.Tensor) -> tuple:
            return tuple((a[s0 : s0 + m].flatten(0, 1), b[s0 : s0 + m].flatten(0, 1)) for s0, m in spans)

        return views(self.k_cache, self.v_cache), views(self.dk_cache, self.dv_cache) if grad else ()

    def _own_grad(self, past: "_SegmentedPast", n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if past.own == 0:
            return None
        R, P, layer = self.resident_pages_per_layer, past.start // self.page_size, past.layer
        end = P + past.own
        out = []
        for gpu, own in ((self.dk_cache, self.own_dk_cache), (self.dv_cache, self.own_dv_cache)):
            parts = []
            if P < R:
                parts.append(gpu[layer * R + P : layer * R + min(R, end)])
            if end > R:
                ob = layer % 2
                parts.append(own[ob * self.own_pages : ob * self.own_pages + end - max(P, R)])
            pages = parts[0] if len(parts) == 1 else torch.cat(parts)
            out.append(pages.flatten(0, 1)[:n])
        return out[0], out[1]


class _SegmentedPast:
    """The :class:`~oomb.ops.paged_attention.PastSegments` of one (chunk, layer) view of an OffloadedKVStore."""

    def __init__(self, store: _SegmentedStaging, layer: int, start: int, own: int) -> None:
        self.store, self.layer, self.start, self.own = store, layer, start, own
        S = store.page_size
        self.bounds = [(lo * S, hi * S) for lo, hi in store._sched.page_bounds(start // S)]
        self._held: dict[tuple[int, bool], int | None] = {}

    def acquire(self, index: int, grad: bool) -> tuple:
        b, tensors = self.store._segment(self, index, grad)
        self._held[(index, grad)] = b
        return tensors

    def runs(self, index: int, grad: bool) -> tuple[tuple, tuple]:
        return self.store._segment_runs(self, index, self._held[(index, grad)], grad)

    def release(self, index: int, grad: bool) -> None:
        b = self._held.pop((index, grad))
        self.store._sched.release(SegUse(self.layer, self.start, index, grad), b)

    def begin_backward(self) -> None:
        self.store._sched.begin_backward(self.layer, self.start, self.own)

    def own_grad(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.store._own_grad(self, n)
