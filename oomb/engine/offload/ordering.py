"""The events that order an offloaded store's two copy streams against each other (docs/design.md §2.3,
"Ordering"): a copy into a staging buffer follows the last write-back out of it, a copy reading a layer's host
pages follows the last device->host copy into them, and whole-layer write-backs go out in pieces with an event
each so the next staging into the set can follow them piece by piece."""

from __future__ import annotations


class _CopyOrdering:
    """Device->host events of :class:`~oomb.engine.offload.OffloadedKVStore` (a mixin: the store holds the
    streams, the pools and the event lists ``_wb_buf``, ``_wb_layer``, ``_wb_pieces``, ``_wb_prev``)."""

    def _d2h_event(self):
        """A new event after everything enqueued so far on the device->host stream."""
        ev = self._streams.event()
        self._streams.record_d2h(ev)
        return ev

    def _wrote_back(self, buf: int, layer: int) -> None:
        """Write-backs out of staging set / buffer ``buf`` into host pages of ``layer`` are enqueued."""
        ev = self._d2h_event()
        self._wb_buf[buf] = ev
        self._wb_layer[layer] = ev

    writeback_pieces = 8
    """Whole-layer staging: a layer's dK/dV write-back is split into about this many pieces (one event each)."""

    def _write_back_pieces(self, s: int, layer: int, base: int, runs: list[tuple[int, int]]) -> None:
        """D2H of the dK/dV slots ``runs`` ([x, y) offsets from ``base``) of set ``s`` into host pages of ``layer``
        (page R + x at slot base + x), in about ``writeback_pieces`` pieces, each followed by an event."""
        st = self._streams
        total = sum(y - x for x, y in runs)
        if total <= 0:
            return
        step = max(1, -(-total // self.writeback_pieces))
        pieces, lo, done = [], None, 0
        for x, y in runs:
            while x < y:
                e = min(y, x + step - done)
                st.d2h_copy_(self.dk_host[layer, x:e], self.dk_cache[base + x : base + e])
                st.d2h_copy_(self.dv_host[layer, x:e], self.dv_cache[base + x : base + e])
                self._stats["d2h_bytes"] += 2 * self.dk_host[layer, x:e].numel() * self.dk_host.element_size()
                lo = x if lo is None else lo
                done += e - x
                x = e
                if done == step:
                    pieces.append((lo, e, self._d2h_event()))
                    lo, done = None, 0
        if self._written is not None:
            written = self._written
            st.d2h_run(lambda: [written[layer, x:y].fill_(True) for x, y in runs])
        if lo is not None:
            pieces.append((lo, runs[-1][1], self._d2h_event()))
        else:
            pieces[-1] = (pieces[-1][0], pieces[-1][1], self._d2h_event())
        self._wb_prev[s] = self._wb_buf[s]
        self._wb_pieces[s] = pieces
        self._wb_buf[s] = pieces[-1][2]
        self._wb_layer[layer] = pieces[-1][2]

    def _writeback_split(self, s: int, x: int, y: int) -> list[tuple[int, int, int]]:
        """Slots [x, y) of set ``s`` cut at the last write-back's piece bounds -> ``(x, y, piece)``, ``piece`` the
        index of the last piece whose slot range overlaps the part (-1: none)."""
        out = []
        pieces = self._wb_pieces[s]
        i = 0
        while x < y:
            while i < len(pieces) and pieces[i][1] <= x:
                i += 1
            if i == len(pieces):
                out.append((x, y, -1))
                break
            lo, hi, _ = pieces[i]
            if x < lo:  # a gap before piece i
                e = min(y, lo)
                out.append((x, e, -1))
                x = e
                continue
            e = min(y, hi)
            out.append((x, e, i))
            x = e
        return out

    def _after_writeback_piece(self, s: int, piece: int) -> None:
        """The host->device stream waits until write-back piece ``piece`` out of set ``s`` has read its slots."""
        if piece >= 0:
            self._streams.copy_wait(self._wb_pieces[s][piece][2])

    def _after_host_writes(self, layer: int) -> None:
        """The host->device stream waits until the host pages of ``layer`` hold what was written to them."""
        if self._wb_layer[layer] is not None:
            self._streams.copy_wait(self._wb_layer[layer])

    def _after_writeback_out_of(self, buf: int) -> None:
        """The host->device stream waits until the last write-back out of set / buffer ``buf`` has read it."""
        if self._wb_buf[buf] is not None:
            self._streams.copy_wait(self._wb_buf[buf])
