"""The segment schedule of offloaded KV pages: which host pages go into which of two GPU staging buffers, and when.

Pure bookkeeping (no tensors, no streams), driven by the calls the engine makes
(:class:`oomb.engine.offload.OffloadedKVStore`, which performs the copies) or by the calls a step is predicted to
make (:func:`oomb.memory.traffic.segment_traffic`, which only counts bytes): the planner's traffic and the store's
copies are one computation. Design reference: docs/design.md §2.3.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

__all__ = ["BufTag", "SegUse", "SegmentSchedule"]


@dataclass(frozen=True)
class SegUse:
    """One attention call's use of one past segment: K/V, plus dK/dV (the call's backward) if ``grad``."""

    layer: int
    start: int  # token offset of the chunk
    seg: int  # segment index (0 = the first, holding the resident pages)
    grad: bool


@dataclass
class BufTag:
    """What a segment staging buffer holds: K/V of host pages [lo, kv_hi) of (layer, seg); dK/dV of
    [lo, grad_hi) as of the backward of the chunk at ``grad_start`` (None: none)."""

    layer: int
    seg: int
    kv_hi: int
    grad_start: int | None = None
    grad_hi: int = 0


class SegmentSchedule:
    """Which host pages go into which of the two segment staging buffers, and when.

    Pure bookkeeping (no tensors): :class:`~oomb.engine.offload.OffloadedKVStore` drives it with the calls the
    engine makes and performs the copies it asks for through ``hooks``; :func:`~oomb.memory.traffic.segment_traffic`
    drives it with the calls a step is predicted to make and only counts bytes. So the
    planner's traffic and the store's are one computation.

    Geometry for a call whose past is ``P`` pages (R resident, SP = segment pages): no segment
    when P == 0; one segment [0, P) when P <= R (resident, nothing staged); else
    ``k = ceil((P - R) / SP)`` segments, segment 0 = pages [0, min(P, R + SP)) (the resident
    prefix plus the first host pages), segment i >= 1 = [R + i*SP, min(P, R + (i+1)*SP)).
    Host pages of segment i: [R + i*SP, hi), staged into buffer slots [0, hi - R - i*SP).

    Prefetch: the step's calls are predicted (Stage 1 chunks 0..N-2, then per chunk from the
    last: forward of layers 0..L-1, then per layer from the top: [forward again where per-layer
    checkpointing reruns the attention (``checkpoint_layers``),] backward), each call's segments
    in order, a backward's in reverse. With
    ``saved_attention`` the Stage-2 forwards of chunks 0..N-2 read no past (the engine's
    ``save_attention`` reuses Stage 1's outputs), so only their backwards are predicted. When a
    segment is acquired, the next predicted segment use that needs host pages is staged into
    the other buffer (or, for the backward right after a forward of the same segment, its
    dK/dV are added to the buffer the forward reads: an "upgrade"). A buffer holding K/V of
    [lo, hi) serves any later use of that segment needing [lo, hi' <= hi). If the engine's
    order departs from the prediction, the schedule re-finds its place (or stages on demand).

    Own gradient pages (the dK/dV later chunks stored for the chunk's own pages, read once by
    its backward) go through two small buffers (own buffer ``layer % 2``), staged when the
    previous backward starts (or ends, if that one uses the same own buffer).
    """

    def __init__(self, hooks, num_layers: int, page_size: int, chunk_size: int, resident: int, segment_pages: int,
                 checkpoint_layers: bool) -> None:
        self.hooks = hooks
        self.L, self.S, self.C, self.R, self.SP = num_layers, page_size, chunk_size, resident, segment_pages
        self.checkpoint_layers = checkpoint_layers
        self.saved_attention = False  # Stage 2 runs no attention forward for chunks 0..N-2 (save_attention)
        self.reset(None)

    # geometry
    def page_bounds(self, past_pages: int) -> list[tuple[int, int]]:
        """Page ranges [lo, hi) of the segments of a past of ``past_pages`` pages."""
        P, R, SP = past_pages, self.R, self.SP
        if P == 0:
            return []
        if P <= R:
            return [(0, P)]
        k = -(-(P - R) // SP)
        return [(0 if i == 0 else R + i * SP, min(P, R + (i + 1) * SP)) for i in range(k)]

    def host_range(self, use: SegUse) -> tuple[int, int] | None:
        """Host pages [lo, hi) ``use`` reads (lo = R + seg*SP), or None when all its pages are resident."""
        hi = min(use.start // self.S, self.R + (use.seg + 1) * self.SP)
        lo = self.R + use.seg * self.SP
        return (lo, hi) if hi > lo else None

    def valid_upto(self, layer: int, seg: int, lo: int, hi: int) -> int:
        """End of the pages of [lo, hi) (one segment) whose host dK/dV were written back (a prefix)."""
        return min(max(self.written[layer].get(seg, 0), lo), hi)

    def page_valid(self, layer: int, page: int) -> bool:
        seg = (page - self.R) // self.SP
        return page < self.written[layer].get(seg, 0)

    # lifecycle
    def reset(self, seq_len: int | None) -> None:
        self.tags: list[BufTag | None] = [None, None]
        self.busy: list[SegUse | None] = [None, None]
        self.last_used = [0, 0]
        self.clock = 0
        self.written: list[dict[int, int]] = [{} for _ in range(self.L)]
        self.stored = [0] * self.L  # pages of each layer whose K/V are in the store (a prefetch reads no others)
        self.own_tag: list[tuple[int, int] | None] = [None, None]
        self.own_deferred: tuple[int, int] | None = None
        self.ahead: collections.deque = collections.deque()
        self.calls = self._predicted_uses(seq_len) if seq_len is not None else iter(())
        self.window = 8 + 4 * self.L * (len(self.page_bounds(-(-(seq_len or 0) // self.S))) + 1)

    def release_from(self, layer: int, keep: int) -> None:
        self.stored[layer] = min(self.stored[layer], keep)
        w = self.written[layer]
        for seg in w:
            w[seg] = min(w[seg], keep)

    def _predicted_uses(self, T: int):
        """Segment uses of one step needing host pages, in the engine's order (see the class docstring)."""
        L, C = self.L, self.C
        N = -(-T // C)

        def fwd(layer, s):
            for i in range(len(self.page_bounds(s // self.S))):
                u = SegUse(layer, s, i, False)
                if self.host_range(u) is not None:
                    yield u

        def bwd(layer, s):
            for i in reversed(range(len(self.page_bounds(s // self.S)))):
                u = SegUse(layer, s, i, True)
                if self.host_range(u) is not None:
                    yield u

        for c in range(N - 1):
            for layer in range(L):
                yield from fwd(layer, c * C)
        for c in range(N - 1, -1, -1):
            recompute = not (self.saved_attention and c < N - 1)  # its forwards read the past
            for layer in range(L if recompute else 0):
                yield from fwd(layer, c * C)
            for layer in range(L - 1, -1, -1):
                if self.checkpoint_layers and recompute:
                    yield from fwd(layer, c * C)
                yield from bwd(layer, c * C)

    def _peek(self, idx: int) -> SegUse | None:
        while len(self.ahead) <= idx:
            nxt = next(self.calls, None)
            if nxt is None:
                return None
            self.ahead.append(nxt)
        return self.ahead[idx]

    def _advance(self, use: SegUse) -> None:
        """Consume ``use`` from the predicted order (and whatever was predicted before it)."""
        for idx in range(self.window):
            u = self._peek(idx)
            if u is None:
                return
            if u == use:
                for _ in range(idx + 1):
                    self.ahead.popleft()
                return

    # buffers
    def _find(self, use: SegUse, hi: int) -> int | None:
        for b, tag in enumerate(self.tags):
            if tag is not None and tag.layer == use.layer and tag.seg == use.seg and tag.kv_hi >= hi:
                return b
        return None

    def _missing(self, use: SegUse, b: int | None, hi: int) -> tuple[bool, bool]:
        kv = b is None
        tag = None if b is None else self.tags[b]
        grad = use.grad and (tag is None or tag.grad_start != use.start or tag.grad_hi < hi)
        return kv, grad

    def _choose(self) -> int:
        """A buffer no kernel is reading: the least recently used one."""
        free = [b for b in (0, 1) if self.busy[b] is None]
        return min(free, key=lambda b: self.last_used[b])

    def _stage(self, b: int, use: SegUse, lo: int, hi: int, kv: bool, grad: bool, why: str) -> None:
        if kv:
            self.tags[b] = BufTag(use.layer, use.seg, hi)
        valid = None
        if grad:
            valid = self.valid_upto(use.layer, use.seg, lo, hi)
            self.tags[b].grad_start, self.tags[b].grad_hi = use.start, hi
        self.hooks.stage(b, use, lo, hi, kv, valid, why)

    def acquire(self, use: SegUse) -> int | None:
        """Make ``use``'s host pages ready for the compute stream -> its buffer (None: all resident)."""
        rng = self.host_range(use)
        if rng is None:
            return None
        lo, hi = rng
        self._advance(use)
        b = self._find(use, hi)
        kv, grad = self._missing(use, b, hi)
        if kv or grad:
            if b is None:
                b = self._choose()
            elif self.busy[b] is not None:
                raise RuntimeError(f"segment buffer {b} is in use by {self.busy[b]} while {use} needs it: "
                                   "segments were acquired out of order")
            self._stage(b, use, lo, hi, kv, grad, "on_demand")
        self.hooks.wait(b)
        self.busy[b] = use
        self.clock += 1
        self.last_used[b] = self.clock
        self._prefetch()
        return b

    def _prefetch(self) -> None:
        """Stage the next predicted use that reads host pages (into a buffer no kernel is reading)."""
        nxt = self._peek(0)
        if nxt is None:
            return
        lo, hi = self.host_range(nxt)
        if hi > self.stored[nxt.layer]:
            return  # Stage 1 has not written those pages yet (the lookahead passed resident-only calls)
        b = self._find(nxt, hi)
        kv, grad = self._missing(nxt, b, hi)
        if not (kv or grad):
            return
        if b is None:
            if all(u is not None for u in self.busy):
                return
            b = self._choose()
        elif self.busy[b] is not None and self.busy[b].grad:
            return  # never add dK/dV under a backward that writes them (staged on demand instead)
        self._stage(b, nxt, lo, hi, kv, grad, "prefetched")

    def release(self, use: SegUse, b: int | None) -> None:
        """The kernels of ``use`` are enqueued; a backward's dK/dV are written back to the host."""
        if b is None:
            return
        self.busy[b] = None
        lo, hi = self.host_range(use)
        if use.grad:
            w = self.written[use.layer]
            w[use.seg] = max(w.get(use.seg, 0), hi)
        self.hooks.release(b, use, lo, hi, use.grad)

    # own gradient pages
    def own_range(self, start: int, own_pages: int) -> tuple[int, int] | None:
        """Host pages of a chunk's own pages [P, P + own_pages) (None when all resident or none)."""
        P = start // self.S
        lo, hi = max(P, self.R), P + own_pages
        return (lo, hi) if hi > lo else None

    def _own_runs(self, layer: int, lo: int, hi: int) -> list[tuple[int, int, bool]]:
        runs: list[tuple[int, int, bool]] = []
        for p in range(lo, hi):
            ok = self.page_valid(layer, p)
            if runs and runs[-1][2] == ok:
                runs[-1] = (runs[-1][0], p + 1, ok)
            else:
                runs.append((p, p + 1, ok))
        return runs

    def _stage_own(self, layer: int, start: int, why: str) -> None:
        rng = self.own_range(start, self.C // self.S)
        if rng is None:
            return
        ob = layer % 2
        self.own_tag[ob] = (layer, start)
        self.hooks.stage_own(ob, layer, rng[0], self._own_runs(layer, *rng), why)

    def begin_backward(self, layer: int, start: int, own_pages: int) -> None:
        """The backward of (chunk at ``start``, ``layer``) starts: its own gradient pages ready, the next one's staged."""
        if self.own_range(start, own_pages) is not None:
            ob = layer % 2
            if self.own_tag[ob] != (layer, start):
                self._stage_own(layer, start, "on_demand")
            self.hooks.wait_own(ob)
        nxt = (layer - 1, start) if layer > 0 else ((self.L - 1, start - self.C) if start > 0 else None)
        self.own_deferred = None
        if nxt is not None and self.own_range(nxt[1], self.C // self.S) is not None:
            if nxt[0] % 2 != layer % 2:
                self._stage_own(*nxt, "prefetched")
            else:
                self.own_deferred = nxt  # its buffer is this backward's: after it

    def end_backward(self, layer: int, start: int) -> None:
        """The backward has read its own gradient pages."""
        self.hooks.own_read(layer % 2)
        if self.own_deferred is not None:
            nxt, self.own_deferred = self.own_deferred, None
            self._stage_own(*nxt, "prefetched")

