"""Two-tier KV page store: GPU-resident pages plus pinned host pages staged on a side stream.

DESIGN.md §2.3. A drop-in for :class:`~oomb.engine.kv_store.PagedKVStore` (same
engine interface) for sequences whose K/V and dK/dV do not fit on the GPU.

**Layout.** Page ``p`` of layer ``l`` (tokens ``p*S .. p*S+S-1``) lives

* on the GPU, in resident slot ``l * R + p``, when ``p < R`` (the first ``R``
  pages of EVERY layer are resident), else
* in host memory at ``k_host[l, p - R]`` (pinned on CUDA), and is copied into a
  staging slot of the GPU pool when an attention needs it.

The attention (reference or Triton) reads ONE pool tensor through a block
table, so the GPU pool is ``[L*R resident pages | 2*W staging slots]`` with
``W = pages_per_layer - R``: two staging sets, set ``l % 2`` for layer ``l``
(current + prefetched next layer). Layer ``l``'s block table is fixed for the
whole step -- ``[l*R, ..., l*R+R-1, base(l%2), base(l%2)+1, ...]`` -- so the
view an autograd Function saved in the Stage-2 forward is still right in its
backward, after the pages were staged again. Host pages of one layer are
contiguous, so a layer's past is staged by one copy per tensor (K, V, dK, dV),
never one copy per page.

**Why the earliest pages are resident.** Page ``p`` is read by every later
chunk, so the earliest pages are read most often: keeping a prefix of every
layer on the GPU removes the most traffic per resident byte, cuts the traffic
of every layer alike (so no layer's copy becomes the one the compute waits
for), and shrinks the staging sets too (they only hold the non-resident
suffix). A GPU budget of ``G`` pages buys ``R = (G - 2n) // (L - 2)`` resident
pages per layer for ``n`` pages per layer (:func:`resident_pages_for_budget`).
(Keeping whole layers resident instead, as the published system does, leaves
the staging sets a whole layer each and the other layers' traffic unchanged.)

**GPU bytes** = ``(L*R + 2*(n - R))`` pages + two one-chunk K/V write buffers. With
the minimum tier (R = 0) the GPU still grows by two layers' pages per token
(Qwen2.5-7B: 2 x 6 KiB = 12 KiB/token, ~126 MB per 10K tokens), because the
attention reads a layer's whole past through one block table. A flat GPU
footprint needs the attention to take the past in fixed-size segments (merged
through the log-sum-exp; the backward needs only the final lse per segment),
so that staging holds a segment, not a layer.

**Schedule** (what is copied when; L layers, chunk c, P past pages)::

    Stage 1, chunk c, layer l:   use K/V[0:P] of l;      prefetch K/V of l+1 (or layer 0 of chunk c+1)
                                 write the chunk's new K/V: resident slots, or owned GPU buffer -> host (D2H)
    Stage 2 fwd, layer l < L-1:  use K/V of l;           prefetch K/V of l+1
    Stage 2 fwd, layer L-1:      use K/V+dK/dV of L-1 (its backward is next); prefetch K/V+dK/dV of L-2
    Stage 2 bwd, layer l:        use K/V+dK/dV of l (incl. the chunk's own dK/dV pages);
                                 after its backward: write back dK/dV[0:P] (D2H), prefetch layer l-2 (or
                                 K/V of layer 0 of chunk c-1)

With per-layer checkpointing the recompute asks for a layer again right before
its backward; that view finds the pages already staged. Host dK/dV pages are
never zeroed on the host: a page whose gradient was never written back is
zero-filled in its staging slot instead of copied.

**Ordering.** Copies run on one side CUDA stream, in issue order. Before a
copy overwrites a staging set it waits on an event the compute stream recorded
after the last kernel that reads the set; before a kernel reads a set the
compute stream waits on the event recorded after the copy into it; a D2H
write-back waits on an event recorded after the kernels that produced the
data. New K/V of Stage 1 go through two owned GPU buffers (the compute stream
waits for the previous D2H out of a buffer before refilling it), so no tensor
of the autograd graph is ever read by the copy stream. Host-side waits are
never used for ordering.

On CPU there are no streams: every copy runs synchronously where it is issued,
with the same schedule, so CPU tests check page placement, prefetch order and
lifetimes, and losses/gradients equal PagedKVStore's bitwise. The stream calls
go through ``_CudaStreams`` / ``_SyncStreams``; tests substitute a simulated
side stream that defers every copy as long as the events allow, which turns a
missing compute-side wait into wrong numbers on CPU.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass

import torch

from ..ops.paged_attention import PagedKV

__all__ = ["OffloadedKVStore", "min_gpu_pages", "resident_pages_for_budget"]


def min_gpu_pages(num_layers: int, pages_per_layer: int) -> int:
    """Smallest GPU pool (pages) for ``pages_per_layer`` pages per layer: two staging sets, or all pages if fewer."""
    return min(2 * pages_per_layer, num_layers * pages_per_layer)


def resident_pages_for_budget(num_layers: int, pages_per_layer: int, gpu_pages: int) -> int:
    """Resident pages per layer (R) that a GPU pool of ``gpu_pages`` pages affords.

    The pool holds ``L*R`` resident pages plus two staging sets of ``n - R`` slots
    (none when ``R == n``). Returns the largest such R.

    Raises:
        ValueError: if ``gpu_pages`` is below :func:`min_gpu_pages`.
    """
    L, n = num_layers, pages_per_layer
    if gpu_pages >= L * n:
        return n
    need = min_gpu_pages(L, n)
    if gpu_pages < need:
        raise ValueError(
            f"a GPU page budget of {gpu_pages} pages cannot stage {n} pages per layer: offload needs at least "
            f"{need} pages on the GPU (two layers' staging); raise gpu_page_budget or shorten the sequence"
        )
    if L <= 2:  # staging two layers costs as much as keeping them all
        return n
    return min(n, (gpu_pages - 2 * n) // (L - 2))


@dataclass(frozen=True)
class _Use:
    """One use of a layer's pages: K/V of ``past`` pages, plus dK/dV of ``past + own`` pages if ``grad``."""

    layer: int
    start: int  # token offset of the chunk
    past: int  # past pages whose K/V are read
    own: int  # the chunk's own pages whose stored dK/dV are read (backward only)
    grad: bool


@dataclass
class _Tag:
    """What a staging set holds."""

    layer: int
    past: int
    kv: bool
    grad_start: int | None = None  # chunk whose dK/dV are staged (None: none)
    grad_own: int = 0


class _CudaStreams:
    """The side copy stream and the events that order it against the compute (current) stream."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy = torch.cuda.Stream(device)

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def record_compute(self) -> torch.cuda.Event:
        """An event after everything enqueued so far on the compute stream."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def compute_wait(self, ev: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(ev)

    def copy_wait(self, ev: torch.cuda.Event) -> None:
        self.copy.wait_event(ev)

    def record_copy(self, ev: torch.cuda.Event) -> None:
        ev.record(self.copy)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.copy):
            dst.copy_(src, non_blocking=True)

    def zero_(self, dst: torch.Tensor) -> None:
        with torch.cuda.stream(self.copy):
            dst.zero_()

    def synchronize(self) -> None:
        self.copy.synchronize()


class _SyncStreams:
    """CPU: no streams; a copy runs where it is issued, events are no-ops."""

    asynchronous = False

    def event(self) -> None:
        return None

    def record_compute(self) -> None:
        return None

    def compute_wait(self, ev) -> None:
        pass

    def copy_wait(self, ev) -> None:
        pass

    def record_copy(self, ev) -> None:
        pass

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def zero_(self, dst: torch.Tensor) -> None:
        dst.zero_()

    def synchronize(self) -> None:
        pass


def _make_streams(device: torch.device):
    """Streams for a store on ``device`` (tests substitute a simulator here)."""
    return _CudaStreams(device) if device.type == "cuda" else _SyncStreams()


def _unregister_host(ptrs: list[int], tensors: list[torch.Tensor]) -> None:
    cudart = torch.cuda.cudart()
    for ptr in ptrs:
        cudart.cudaHostUnregister(ptr)
    tensors.clear()


class OffloadedKVStore:
    """K/V and fp32 dK/dV pages of one training sequence in two tiers (GPU + pinned host).

    Args:
        num_layers: decoder layers (L).
        num_kv_heads: KV heads per layer (Hkv).
        head_dim: D.
        page_size: tokens per page (S).
        max_seq_len: tokens the store is sized for; ``n = ceil(max_seq_len / S)`` pages per layer.
        dtype: K/V dtype (the model's).
        device: the compute device (``cuda`` or, for simulation, ``cpu``).
        chunk_size: the engine's chunk size in tokens (to predict the next chunk's pages).
        gpu_pages: GPU pool budget in pages, staging included; ``None`` = the minimum
            (every page in the host tier, two staging sets). See :func:`resident_pages_for_budget`.
        grad_dtype: dK/dV dtype; default float32 (float64 for a float64 model).
        trace: record every transfer in :attr:`trace` (tests).

    Attributes:
        k_cache, v_cache: [L*R + 2*W, S, Hkv, D] GPU pool (model dtype): resident pages, then two staging sets.
        dk_cache, dv_cache: same shape, ``grad_dtype``.
        k_host, v_host, dk_host, dv_host: [L, W, S, Hkv, D] host tier (pinned on CUDA).
        resident_pages_per_layer: R. staging_pages: W (per set).
        stats: bytes copied each way, stagings issued ahead ("prefetched") or at the point of use ("on_demand").

    Raises:
        ValueError: a budget below two layers' staging.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        chunk_size: int,
        gpu_pages: int | None = None,
        grad_dtype: torch.dtype | None = None,
        trace: bool = False,
    ) -> None:
        if chunk_size % page_size:
            raise ValueError(f"chunk_size ({chunk_size}) must be a multiple of page_size ({page_size})")
        self.num_layers = L = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = S = page_size
        self.chunk_size = chunk_size
        self.dtype = dtype
        self.grad_dtype = grad_dtype or (torch.float64 if dtype == torch.float64 else torch.float32)
        self.device = torch.device(device)
        self.max_pages_per_layer = n = -(-max_seq_len // S)
        self.num_pages = L * n  # logical pages, both tiers
        self.gpu_page_budget = min_gpu_pages(L, n) if gpu_pages is None else gpu_pages
        self.resident_pages_per_layer = R = resident_pages_for_budget(L, n, self.gpu_page_budget)
        self.staging_pages = W = n - R
        self.gpu_pool_pages = L * R + 2 * W
        self._cuda = self.device.type == "cuda"

        shape = (self.gpu_pool_pages, S, num_kv_heads, head_dim)
        self.k_cache = torch.empty(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.empty(shape, dtype=dtype, device=self.device)
        self.dk_cache = torch.empty(shape, dtype=self.grad_dtype, device=self.device)
        self.dv_cache = torch.empty(shape, dtype=self.grad_dtype, device=self.device)
        hshape = (L, W, S, num_kv_heads, head_dim)
        self._host_pins: list[int] = []
        self.k_host = self._host_empty(hshape, dtype)
        self.v_host = self._host_empty(hshape, dtype)
        self.dk_host = self._host_empty(hshape, self.grad_dtype)
        self.dv_host = self._host_empty(hshape, self.grad_dtype)
        if self._host_pins:
            fin = weakref.finalize(self, _unregister_host, list(self._host_pins), [self.k_host, self.v_host, self.dk_host, self.dv_host])
            fin.atexit = False  # the process's exit releases the pins anyway

        # Fixed block tables: layer l's page p -> resident slot or a slot of staging set l % 2.
        table = torch.empty((L, n), dtype=torch.int32)
        for layer in range(L):
            table[layer, :R] = torch.arange(layer * R, layer * R + R, dtype=torch.int32)
            base = L * R + (layer % 2) * W
            table[layer, R:] = torch.arange(base, base + W, dtype=torch.int32)
        self.block_table = table.to(self.device)

        # The copy stream and events; owned buffers for Stage-1 writes to the host tier (two,
        # alternating, one chunk each) when copies are asynchronous.
        self._streams = st = _make_streams(self.device)
        self._ready = [st.event(), st.event()]  # copy into staging set s done
        self._free = [st.event(), st.event()]  # readers of staging set s done
        self._wbuf_free = [st.event(), st.event()]  # D2H out of write buffer b done
        if st.asynchronous and W > 0:
            wshape = (2, chunk_size // S, S, num_kv_heads, head_dim)
            self._wbuf_k = torch.empty(wshape, dtype=dtype, device=self.device)
            self._wbuf_v = torch.empty(wshape, dtype=dtype, device=self.device)
        else:
            self._wbuf_k = self._wbuf_v = None
        self.trace: list[tuple] | None = [] if trace else None
        self.reset()

    # ------------------------------------------------------------------ memory
    def _host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host tensor; page-locked on CUDA.

        ``torch.empty(pin_memory=True)`` rounds every pinned block up to a power of two
        (PyTorch's CachingHostAllocator), which would waste up to half of host RAM at the sizes
        planned here, so the tensor is allocated pageable and registered with cudaHostRegister
        (unregistered when the store is collected). Falls back to ``pin_memory=True`` if
        registration fails.
        """
        t = torch.empty(shape, dtype=dtype)
        if not self._cuda or t.numel() == 0:
            return t
        nbytes = t.numel() * t.element_size()
        try:
            err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
            code = int(getattr(err, "value", err))
        except Exception as exc:  # pragma: no cover - depends on the CUDA build
            err, code = exc, -1
        if code == 0:
            self._host_pins.append(t.data_ptr())
            return t
        warnings.warn(f"cudaHostRegister of {nbytes / 2**30:.1f} GiB failed ({err}); using pin_memory=True (rounded up to a power of two)")
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    @staticmethod
    def pages_needed(num_layers: int, seq_len: int, page_size: int) -> int:
        """Logical pages (both tiers) for ``seq_len`` tokens over ``num_layers`` layers."""
        return num_layers * -(-seq_len // page_size)

    @property
    def nbytes(self) -> int:
        """GPU bytes held by the store: the pool (resident + staging, K, V, dK, dV) and the write buffers."""
        tensors = [self.k_cache, self.v_cache, self.dk_cache, self.dv_cache]
        if self._wbuf_k is not None:
            tensors += [self._wbuf_k, self._wbuf_v]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def host_nbytes(self) -> int:
        """Host bytes of the host tier (K, V, dK, dV)."""
        return sum(t.numel() * t.element_size() for t in (self.k_host, self.v_host, self.dk_host, self.dv_host))

    def fits(self, seq_len: int) -> bool:
        """Whether a sequence of ``seq_len`` tokens fits in this store."""
        return -(-seq_len // self.page_size) <= self.max_pages_per_layer

    def page_location(self, layer: int, page: int) -> tuple[str, int]:
        """('gpu', resident slot) or ('host', index into ``k_host[layer]``) of page ``page`` of ``layer``."""
        R = self.resident_pages_per_layer
        return ("gpu", layer * R + page) if page < R else ("host", page - R)

    # --------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        """Forget every page (start of a step). Waits for copies still in flight from an aborted step."""
        self._streams.synchronize()
        L = self.num_layers
        self._pages = [0] * L  # pages stored per layer
        self._grad_valid = [0] * L  # host dK/dV valid for pages [R, _grad_valid) of each layer
        self._tag: list[_Tag | None] = [None, None]
        self._busy = [False, False]
        self._owner = [-1, -1]  # layer whose use holds each staging set while busy
        self._pending: _Use | None = None
        self._inflight: dict[int, _Use] = {}
        self._seen_start: int | None = None
        self._seen_layers: set[int] = set()
        self._wbuf_next = 0
        self._seq_len: int | None = None
        self.stats = {"h2d_bytes": 0, "d2h_bytes": 0, "prefetched": 0, "on_demand": 0}
        if self.trace is not None:
            self.trace.clear()

    def begin_step(self, seq_len: int) -> None:
        """Tell the store the step's length (bounds the prefetch of a next chunk)."""
        if not self.fits(seq_len):
            raise ValueError(f"{seq_len} tokens do not fit a store sized for {self.max_pages_per_layer * self.page_size}")
        self._seq_len = seq_len

    @property
    def num_free_pages(self) -> int:
        return self.num_pages - sum(self._pages)

    def num_layer_pages(self, layer: int) -> int:
        return self._pages[layer]

    def release_from(self, layer: int, start: int) -> None:
        """Forget the pages of tokens [start, end) of ``layer`` (start page-aligned)."""
        S = self.page_size
        if start % S:
            raise ValueError(f"release_from: start {start} is not page-aligned (page_size {S})")
        keep = start // S
        self._pages[layer] = min(self._pages[layer], keep)
        self._grad_valid[layer] = min(self._grad_valid[layer], keep)
        if self.trace is not None:
            self.trace.append(("release", layer, keep))

    # ---------------------------------------------------------------- writes
    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a chunk's K/V ([n, Hkv, D] each) for ``layer`` at token ``start`` (page-aligned, appended).

        Resident pages are written on the compute stream and their gradient pages zeroed;
        host pages go through an owned GPU buffer and a D2H copy on the side stream.

        Raises:
            ValueError: if ``start`` is not page-aligned or does not follow the stored tokens.
            RuntimeError: if the layer would hold more pages than the store was sized for.
        """
        S, R = self.page_size, self.resident_pages_per_layer
        if start % S != 0 or start // S != self._pages[layer]:
            raise ValueError(
                f"layer {layer}: write at token {start} must be page-aligned and follow the "
                f"{self._pages[layer] * S} tokens already stored"
            )
        n = k.shape[0]
        p0 = start // S
        p1 = p0 + -(-n // S)
        if p1 > self.max_pages_per_layer:
            raise RuntimeError(f"layer {layer} would hold {p1} pages, more than the {self.max_pages_per_layer} this store was sized for")
        Hkv, D = self.num_kv_heads, self.head_dim
        if p0 < R:  # resident prefix
            q1 = min(p1, R)
            nt = min(n, (q1 - p0) * S)
            a, b = layer * R + p0, layer * R + q1
            self.k_cache[a:b].view(-1, Hkv, D)[:nt] = k[:nt]
            self.v_cache[a:b].view(-1, Hkv, D)[:nt] = v[:nt]
            self.dk_cache[a:b].zero_()
            self.dv_cache[a:b].zero_()
        if p1 > R:  # host tier
            a = max(p0, R)
            t0 = (a - p0) * S
            nt = n - t0
            hk = self.k_host[layer, a - R : p1 - R].view(-1, Hkv, D)[:nt]
            hv = self.v_host[layer, a - R : p1 - R].view(-1, Hkv, D)[:nt]
            st = self._streams
            if self._wbuf_k is None:
                hk.copy_(k[t0:])
                hv.copy_(v[t0:])
            else:
                if nt > self._wbuf_k.shape[1] * S:
                    raise RuntimeError(f"a write of {nt} tokens exceeds the {self._wbuf_k.shape[1] * S}-token write buffer (chunk_size)")
                b = self._wbuf_next
                self._wbuf_next ^= 1
                st.compute_wait(self._wbuf_free[b])  # the previous D2H out of this buffer is done
                wk = self._wbuf_k[b].view(-1, Hkv, D)[:nt]
                wv = self._wbuf_v[b].view(-1, Hkv, D)[:nt]
                wk.copy_(k[t0:])
                wv.copy_(v[t0:])
                st.copy_wait(st.record_compute())  # the buffer is filled
                st.copy_(hk, wk)
                st.copy_(hv, wv)
                st.record_copy(self._wbuf_free[b])
            self.stats["d2h_bytes"] += 2 * nt * Hkv * D * k.element_size()
            if self.trace is not None:
                self.trace.append(("write_host", layer, a, p1))
        self._pages[layer] = p1

    # --------------------------------------------------------------- staging
    def _set(self, layer: int) -> int:
        return layer % 2

    def _satisfied(self, use: _Use) -> tuple[bool, bool]:
        """(K/V present, dK/dV present) for ``use`` in its staging set (trivially so when all resident)."""
        R = self.resident_pages_per_layer
        tag = self._tag[self._set(use.layer)]
        kv_here = tag is not None and tag.layer == use.layer and tag.past == use.past and tag.kv
        kv_ok = use.past <= R or kv_here
        grad_ok = (
            not use.grad
            or use.past + use.own <= R
            or (kv_here and tag.grad_start == use.start and tag.grad_own == use.own)
        )
        return kv_ok, grad_ok

    def _stage(self, use: _Use, why: str) -> None:
        """Copy what ``use`` lacks into staging set ``layer % 2`` (side stream)."""
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
        if not kv_ok:
            m = use.past - R
            st.copy_(self.k_cache[base : base + m], self.k_host[layer, :m])
            st.copy_(self.v_cache[base : base + m], self.v_host[layer, :m])
            self.stats["h2d_bytes"] += 2 * self.k_host[layer, :m].numel() * self.k_host.element_size()
            tag = _Tag(layer, use.past, kv=True)
        if not grad_ok:
            end = use.past + use.own - R
            valid = min(max(self._grad_valid[layer] - R, 0), end)
            if valid:
                st.copy_(self.dk_cache[base : base + valid], self.dk_host[layer, :valid])
                st.copy_(self.dv_cache[base : base + valid], self.dv_host[layer, :valid])
                self.stats["h2d_bytes"] += 2 * self.dk_host[layer, :valid].numel() * self.dk_host.element_size()
            if end > valid:  # never written back: zero on the device instead of copying
                st.zero_(self.dk_cache[base + valid : base + end])
                st.zero_(self.dv_cache[base + valid : base + end])
            if tag is None or tag.layer != layer or tag.past != use.past:
                tag = _Tag(layer, use.past, kv=use.past <= R)
            tag.grad_start, tag.grad_own = use.start, use.own
        st.record_copy(self._ready[s])
        self._tag[s] = tag
        self.stats[why] += 1
        if self.trace is not None:
            self.trace.append(("stage", why, layer, use.start, use.past, use.own if use.grad else None))

    def _acquire(self, use: _Use) -> None:
        """Make ``use``'s pages ready for the compute stream (staging now what was not prefetched)."""
        if self._pending == use:
            self._pending = None
        self._stage(use, "on_demand")
        s = self._set(use.layer)
        self._streams.compute_wait(self._ready[s])
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

    def _next_chunk_forward(self, start: int) -> _Use | None:
        """Layer 0's K/V use of the chunk at token ``start`` (None past the sequence)."""
        if start < 0 or (self._seq_len is not None and start >= self._seq_len):
            return None
        return _Use(0, start, start // self.page_size, 0, False)

    def _next_backward(self, use: _Use) -> _Use | None:
        """The use after the backward of ``use.layer``: the next lower layer's backward, or chunk c-1's forward."""
        if use.layer > 0:
            return _Use(use.layer - 1, use.start, use.past, use.own, True)
        return self._next_chunk_forward(use.start - self.chunk_size) if use.start > 0 else None

    # ------------------------------------------------------ engine interface
    def attention_view(
        self, layer: int, stage: int, start: int, length: int, is_last: bool, q_doc_start: torch.Tensor | None = None
    ) -> PagedKV:
        """The paged state of (chunk at token ``start``, ``layer``), its pages staged on the GPU.

        Same contract as :meth:`PagedKVStore.attention_view`. In Stage 2 the returned view's
        ``after_backward`` writes the updated past dK/dV back to the host and readies the next layer.
        """
        S, L = self.page_size, self.num_layers
        past = start // S
        table = self.block_table[layer]
        if self.trace is not None:
            self.trace.append(("view", stage, layer, start))
        if stage == 1:
            use = _Use(layer, start, past, 0, False)
            self._acquire(use)
            nxt = _Use(layer + 1, start, past, 0, False) if layer + 1 < L else self._next_chunk_forward(start + length)
            self._prefetch(nxt)
            return PagedKV(self.k_cache, self.v_cache, table[:past], start, q_doc_start=q_doc_start)
        if self._seen_start != start:
            self._seen_start, self._seen_layers = start, set()
        recompute = layer in self._seen_layers  # per-layer checkpointing re-runs the forward in backward
        self._seen_layers.add(layer)
        own = 0 if is_last else -(-length // S)
        bwd = _Use(layer, start, past, own, True)  # what this view's backward reads
        grad = recompute or layer == L - 1  # the backward of this view comes next
        use = bwd if grad else _Use(layer, start, past, 0, False)
        self._acquire(use)
        if grad:
            nxt = self._next_backward(bwd)
        elif layer + 1 == L - 1:  # the top layer's forward is followed by its backward: stage its dK/dV too
            nxt = _Use(layer + 1, start, past, own, True)
        else:
            nxt = _Use(layer + 1, start, past, 0, False)
        self._prefetch(nxt)
        own_table = None if is_last else table[past : past + own]
        return PagedKV(
            self.k_cache, self.v_cache, table[:past], start, self.dk_cache, self.dv_cache, own_table, q_doc_start,
            after_backward=functools.partial(self._after_backward, bwd),
        )

    def layer_block_table(self, layer: int, num_pages: int) -> torch.Tensor:
        """int32 [num_pages] GPU slots of the first ``num_pages`` pages of ``layer`` (resident or staging; a view)."""
        return self.block_table[layer, :num_pages]

    def after_attention_forward(self, layer: int, stage: int) -> None:
        """The attention forward of ``layer`` is enqueued: a K/V-only staging set may be refilled."""
        use = self._inflight.get(layer)
        if use is not None and not use.grad:
            self._release(layer, self._streams.record_compute())

    def _after_backward(self, use: _Use) -> None:
        """Write the layer's updated past dK/dV back to the host; ready the next layer's backward."""
        R, W, L = self.resident_pages_per_layer, self.staging_pages, self.num_layers
        s = self._set(use.layer)
        st = self._streams
        done = st.record_compute()  # the backward kernels of this layer are enqueued before this point
        m = use.past - R
        if m > 0:
            base = L * R + s * W
            st.copy_wait(done)
            st.copy_(self.dk_host[use.layer, :m], self.dk_cache[base : base + m])
            st.copy_(self.dv_host[use.layer, :m], self.dv_cache[base : base + m])
            self.stats["d2h_bytes"] += 2 * self.dk_host[use.layer, :m].numel() * self.dk_host.element_size()
            self._grad_valid[use.layer] = max(self._grad_valid[use.layer], use.past)
            if self.trace is not None:
                self.trace.append(("writeback", use.layer, use.start, use.past))
        self._release(use.layer, done)
        nxt = self._next_backward(use)
        if nxt is not None and nxt.grad:
            self._acquire(nxt)  # its backward comes next: the compute stream waits for its pages here
            self._prefetch(self._next_backward(nxt))
        else:
            self._prefetch(nxt)

    # ------------------------------------------------------------------ tests
    def read_grad(self, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored dK/dV of tokens [start, start+n) of ``layer`` -> two [n, Hkv, D] tensors (synchronises)."""
        self._streams.synchronize()
        if self._cuda:
            torch.cuda.synchronize(self.device)
        S, R = self.page_size, self.resident_pages_per_layer
        out = []
        for gpu, host in ((self.dk_cache, self.dk_host), (self.dv_cache, self.dv_host)):
            pages = []
            for p in range(start // S, -(-(start + n) // S)):
                if p < R:
                    pages.append(gpu[layer * R + p].cpu())
                elif p < self._grad_valid[layer]:
                    pages.append(host[layer, p - R].clone())
                else:
                    pages.append(torch.zeros_like(host[layer, 0]))
            flat = torch.stack(pages).flatten(0, 1)
            off = start - (start // S) * S
            out.append(flat[off : off + n])
        return out[0], out[1]
