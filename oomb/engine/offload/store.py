"""The two-tier KV page store: :class:`OffloadedKVStore` (the layout, the schedules and the ordering are described
in :mod:`oomb.engine.offload`; docs/design.md §2.3)."""

from __future__ import annotations

import functools
import warnings
import weakref

import torch

from ...memory.schedule import SegmentSchedule
from ...memory.tiering import (choose_staging_sets, kv_stash_tiles, min_gpu_pages, resident_pages_for_budget,
                               resolve_segment_pages, stage1_shadow_pages, staging_pages)
from ...ops.page_gather import DEFAULT_PROGRAMS
from ...ops.paged_attention import PagedKV
from .head_tiles import _HeadTileStaging, _zero_copy_works, copy_kernel_args
from .layout import host_empty, pool_pair, segment_tables, unregister_host, whole_layer_tables
from .ordering import _CopyOrdering
from .segmented import _SegmentedPast, _SegmentedStaging
from .streams import make_streams as _make_streams
from .uses import _Tag, _Use
from .whole_layer import _WholeLayerStaging

__all__ = ["OffloadedKVStore"]


def _check_options(staging_sets, stage_grain, stage1_shadow, stage1_shadow_partial, copy_streams, kv_stash_mib,
                   page_gather_programs, page_gather_warps, page_gather_elems) -> None:
    """Validate the keyword options of :class:`OffloadedKVStore` (before anything is allocated: pinning the host
    tier takes ~35 s at 1M tokens).

    Raises:
        ValueError: the first bad value, naming the argument.
    """
    if staging_sets is not None and (isinstance(staging_sets, bool) or not isinstance(staging_sets, int)
                                     or staging_sets < 2):
        raise ValueError(f"staging_sets must be an integer >= 2, or None to pick them from the pool; got {staging_sets!r}")
    if stage_grain not in ("head", "page"):
        raise ValueError(f"stage_grain must be 'head' or 'page'; got {stage_grain!r}")
    for name, value in (("stage1_shadow", stage1_shadow), ("stage1_shadow_partial", stage1_shadow_partial)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False; got {value!r}")
    if isinstance(copy_streams, bool) or copy_streams not in (1, 2):
        raise ValueError(f"copy_streams must be 1 or 2; got {copy_streams!r}")
    if isinstance(kv_stash_mib, bool) or not isinstance(kv_stash_mib, int) or kv_stash_mib < 0:
        raise ValueError(f"kv_stash_mib must be an integer >= 0; got {kv_stash_mib!r} (0: no stash)")
    if isinstance(page_gather_programs, bool) or not isinstance(page_gather_programs, int) or page_gather_programs < 1:
        raise ValueError(f"page_gather_programs must be a positive integer; got {page_gather_programs!r}")
    for name, value, lo, hi in (("page_gather_warps", page_gather_warps, 1, 32),
                                ("page_gather_elems", page_gather_elems, 128, 65536)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not (lo <= value <= hi and value & (value - 1) == 0):
            raise ValueError(f"{name} must be a power of two from {lo} to {hi}, or None for the kernel's default; "
                             f"got {value!r}")


class OffloadedKVStore(_SegmentedStaging, _WholeLayerStaging, _HeadTileStaging, _CopyOrdering):
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
        gpu_pages: GPU pool budget in pages (resident + staging; the own-gradient and write
            buffers come on top); ``None`` = the minimum (every page in the host tier, two staging
            buffers). See :func:`~oomb.memory.tiering.resident_pages_for_budget`.
        grad_dtype: dK/dV dtype; default float32 (float64 for a float64 model).
        trace: record every transfer in :attr:`trace` (tests).
        segment_pages: staging segment in pages (an int >= 1), ``'auto'`` (default:
            :func:`~oomb.memory.tiering.default_segment_pages`, 32K tokens) or ``'layer'`` (whole-layer staging: the
            attention reads a layer's whole past through one block table, as the sparse attention
            needs; GPU bytes then grow with the context).
        checkpoint_layers: the engine reruns each layer's attention forward before its backward
            (per-layer checkpointing with ``checkpoint_attention='recompute'``, :attr:`oomb.OOMBConfig.reruns_attention`);
            only the prefetch order depends on it.
        staging_sets: whole-layer staging buffers (an integer >= 2), or None to pick them from the pool
            (:func:`~oomb.memory.tiering.choose_staging_sets`). Ignored with segments.
        stage_grain: Stage-2 staging grain of a sparse (chunk, layer) whose selection is known: ``'head'`` moves
            only the (page, KV head) tiles of the selection (:mod:`oomb.ops.page_gather`: zero-copy kernels on
            CUDA, with the ``needed_heads`` hook); ``'page'`` moves whole pages of the selection's page union
            (runs, with the ``needed_pages`` hook). A GPU that cannot address pinned memory falls back to 'page'.
        stage1_shadow: whole-layer staging: Stage 1 keeps the K/V of host pages in the pool's dK/dV bytes and reads
            them in place (package docstring, "Stage-1 shadow").
        stage1_shadow_partial: ... also when the dK/dV bytes hold only a prefix of each layer's host pages (the
            rest staged as before; bitwise equal to no shadow on CPU and on an H200).
        copy_streams: CUDA streams for the copies: 2 (host->device and device->host at once) or 1 (serialised).
        kv_stash_mib: MiB of the Stage-2 K/V stash (package docstring, "K/V stash"; head grain); 0: none.
        page_gather_programs, page_gather_warps, page_gather_elems: launch settings of the tile copy kernels
            (:mod:`oomb.ops.page_gather`): programs, warps per program and elements per load (None: the kernel's
            default; powers of two, 1..32 and 128..65,536).

    Attributes:
        k_cache, v_cache: [L*R + K*W, S, Hkv, D] GPU pool (model dtype): resident pages, then ``K`` staging buffers
            (``staging_sets``: 2 with segments, 2 to 4 with whole layers).
        dk_cache, dv_cache: same shape, ``grad_dtype``.
        own_dk_cache, own_dv_cache: [2*O, S, Hkv, D] ``grad_dtype``, O = min(chunk pages, n - R):
            the own-gradient buffers (segmented staging only, else None); own_pages: O (0 without).
        k_host, v_host, dk_host, dv_host: [L, n - R, S, Hkv, D] host tier (pinned on CUDA).
        resident_pages_per_layer: R. staging_pages: W (per buffer): n - R with whole-layer staging,
            else min(segment_pages, n - R). segment_pages: the segment (None: whole layer).
        stats: bytes copied each way, stagings issued ahead ("prefetched") or at the point of use ("on_demand").
        needed_pages: None, or a callable ``(layer, start) -> sorted list[int] | None`` naming the logical
            past pages the attention of (``layer``, chunk at token ``start``) reads in Stage 2 (None:
            unknown, all). With whole-layer staging, Stage 2 then stages and writes back only those
            pages (see the package docstring, :mod:`oomb.engine.offload`); segmented staging ignores it. Set by the engine for
            sparse attention; not cleared by :meth:`reset`.
        needed_heads: None, or a callable ``(layer, start) -> int32 [nb, Hkv, K] | None``: the selection's
            ``page_idx`` (logical pages per query block and KV head, -1 padded; on the device) of that
            Stage-2 attention, None when unknown or dense. With whole-layer staging and
            :attr:`stage_grain` ``'head'`` it takes precedence over ``needed_pages``: Stage 2 stages and
            writes back only the (page, KV head) tiles the selection reads (package docstring).
        stage_grain: ``'head'`` or ``'page'``, as given (or 'page' where zero-copy does not work).
        stage1_shadow_pages: Sh, host pages per layer Stage 1 reads from the pool's dK/dV bytes instead of
            staging them (whole-layer staging; 0 when off or segmented; package docstring, "Stage-1 shadow").
        kv_stash_tiles: C, (page, KV head) K/V tiles per layer below L - 2 kept from a Stage-2 forward for
            that layer's backward (head grain only; 0 when off; package docstring, "K/V stash").

    Raises:
        ValueError: a budget below two staging buffers; a bad ``segment_pages``, ``staging_sets`` or keyword
            option (naming it).
    """

    #: Selected-page staging (``needed_pages``): runs at most this many pages apart are merged, and
    #: the whole non-resident past is staged when the merged runs cover ``stage_whole_fraction`` of
    #: it or number more than ``stage_max_runs`` (see :func:`~oomb.engine.offload.uses._coalesce_runs`).
    stage_merge_gap_pages: int = 1
    stage_whole_fraction: float = 0.5
    stage_max_runs: int = 256

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
        segment_pages: int | str = "auto",
        checkpoint_layers: bool = False,
        staging_sets: int | None = None,
        *,
        stage_grain: str = "head",
        stage1_shadow: bool = True,
        stage1_shadow_partial: bool = True,
        copy_streams: int = 2,
        kv_stash_mib: int = 0,
        page_gather_programs: int = DEFAULT_PROGRAMS,
        page_gather_warps: int | None = None,
        page_gather_elems: int | None = None,
    ) -> None:
        if chunk_size % page_size:
            raise ValueError(f"chunk_size ({chunk_size}) must be a multiple of page_size ({page_size})")
        SP = resolve_segment_pages(segment_pages, page_size)
        _check_options(staging_sets, stage_grain, stage1_shadow, stage1_shadow_partial, copy_streams, kv_stash_mib,
                       page_gather_programs, page_gather_warps, page_gather_elems)
        self.gather_programs = page_gather_programs
        self._copy_kernel_args = copy_kernel_args(page_gather_programs, page_gather_warps, page_gather_elems)
        self.stage1_shadow = stage1_shadow
        self.stage1_shadow_partial = stage1_shadow_partial
        self.kv_stash_mib = kv_stash_mib
        self._size(num_layers, num_kv_heads, head_dim, page_size, max_seq_len, dtype, device, chunk_size, gpu_pages,
                   grad_dtype, SP, staging_sets)
        self._allocate_tiers()
        self._make_tables(checkpoint_layers)
        self._make_copy_state(copy_streams)
        self.trace: list[tuple] | None = [] if trace else None
        self.needed_pages = None
        self.kv_stash_tiles = 0
        self._stash_k = self._stash_v = None
        self.needed_heads = None
        self._make_tile_state(stage_grain, kv_stash_mib)
        self.reset()

    def _size(self, L, num_kv_heads, head_dim, S, max_seq_len, dtype, device, chunk_size, gpu_pages, grad_dtype,
              SP, staging_sets) -> None:
        """The geometry: pages per layer (n), resident (R), staging buffers (K of W pages), the Stage-1 shadow."""
        self.num_layers = L
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = S
        self.chunk_size = chunk_size
        self.dtype = dtype
        self.grad_dtype = grad_dtype or (torch.float64 if dtype == torch.float64 else torch.float32)
        self.device = torch.device(device)
        self.max_pages_per_layer = n = -(-max_seq_len // S)
        self.num_pages = L * n  # logical pages, both tiers
        self.gpu_page_budget = min_gpu_pages(L, n, SP, staging_sets) if gpu_pages is None else gpu_pages
        self.resident_pages_per_layer = R = resident_pages_for_budget(L, n, self.gpu_page_budget, SP, staging_sets)
        self.segment_pages = SP
        self.segmented = SP is not None
        self.host_pages_per_layer = H = n - R
        self.staging_pages = W = staging_pages(n, R, SP)
        self.staging_sets = K = choose_staging_sets(L, n, self.gpu_page_budget, SP, staging_sets)
        self.gpu_pool_pages = L * R + K * W
        self._cuda = self.device.type == "cuda"
        self.stage1_shadow_pages = (
            stage1_shadow_pages(L, n, R, self.gpu_pool_pages, dtype, self.grad_dtype, self.stage1_shadow_partial)
            if self.stage1_shadow and not self.segmented and H > 0 else 0
        )

    def _allocate_tiers(self) -> None:
        """The GPU pool (K and dK, V and dV sharing one allocation each) and the host tier (pinned on CUDA)."""
        L, H, S = self.num_layers, self.host_pages_per_layer, self.page_size
        Hkv, D, dtype = self.num_kv_heads, self.head_dim, self.dtype
        shape = (self.gpu_pool_pages, S, Hkv, D)
        # K and dK (V and dV) share one allocation, so that Stage 1 can read K/V pages kept in the (then unused)
        # dK/dV bytes through the same tensor as the pool (see "Stage-1 shadow" in the package docstring).
        self.k_cache, self.dk_cache, self._k1, self._shadow_base = pool_pair(shape, dtype, self.grad_dtype, self.device)
        self.v_cache, self.dv_cache, self._v1, _ = pool_pair(shape, dtype, self.grad_dtype, self.device)
        hshape = (L, H, S, Hkv, D)
        self._host_pins: list[int] = []
        self.k_host = self._host_empty(hshape, dtype)
        self.v_host = self._host_empty(hshape, dtype)
        self.dk_host = self._host_empty(hshape, self.grad_dtype)
        self.dv_host = self._host_empty(hshape, self.grad_dtype)
        if self._host_pins:
            tiers = [self.k_host, self.v_host, self.dk_host, self.dv_host]
            fin = weakref.finalize(self, unregister_host, list(self._host_pins), tiers)
            fin.atexit = False  # the process's exit releases the pins anyway

    def _make_tables(self, checkpoint_layers: bool) -> None:
        """Block tables (fixed per layer with whole-layer staging; per buffer with segments), the own-gradient
        buffers and the segment schedule."""
        L, n, R, W, S = (self.num_layers, self.max_pages_per_layer, self.resident_pages_per_layer,
                         self.staging_pages, self.page_size)
        self.own_dk_cache = self.own_dv_cache = None
        self.own_pages = 0
        self._sched = None
        if not self.segmented:
            self.block_table, self._table1 = whole_layer_tables(L, n, R, self.staging_sets, W,
                                                                self.stage1_shadow_pages, self._shadow_base,
                                                                self.device)
        else:
            self.block_table = None
            self._first_tables, self._ramp = segment_tables(L, n, R, W, self.gpu_pool_pages, self.device)
            O = min(self.chunk_size // S, self.host_pages_per_layer)
            oshape = (2 * O, S, self.num_kv_heads, self.head_dim)
            self.own_pages = O
            self.own_dk_cache = torch.empty(oshape, dtype=self.grad_dtype, device=self.device)
            self.own_dv_cache = torch.empty(oshape, dtype=self.grad_dtype, device=self.device)
            self._sched = SegmentSchedule(self, L, S, self.chunk_size, R, self.segment_pages, checkpoint_layers)

    def _make_copy_state(self, copy_streams: int) -> None:
        """The copy streams and events; owned buffers for Stage-1 writes to the host tier (two, alternating, one
        chunk each) when copies are asynchronous."""
        K, L = self.staging_sets, self.num_layers
        self._streams = st = _make_streams(self.device, copy_streams)
        self._ready = [st.event() for _ in range(K)]  # copy into staging set s done
        self._free = [st.event() for _ in range(K)]  # readers of staging set s done
        self._wbuf_free = [st.event(), st.event()]  # D2H out of write buffer b done
        self._own_ready = [st.event(), st.event()]  # copy into own-gradient buffer b done
        self._own_free = [st.event(), st.event()]  # the backward reading own-gradient buffer b is enqueued
        # Device->host copies run on their own stream, concurrently with host->device ones (PCIe is
        # full duplex), so the two orders a single stream gave for free are events now: a copy INTO
        # staging set / buffer s waits for the last write-back OUT of it (_wb_buf[s]), and a copy
        # reading host pages of layer l waits for the last device->host copy into them (_wb_layer[l]).
        self._wb_buf = [None] * K
        self._wb_layer: list = [None] * L
        # Whole-layer staging writes a layer's dK/dV back in pieces (slot ranges with an event each), so
        # the dK/dV staging of the layer that reuses the set (two layers down) can follow the write-back
        # piece by piece instead of waiting for all of it; _wb_prev[s]: the write-backs before those.
        self._wb_pieces: list[list] = [[] for _ in range(K)]
        self._wb_prev = [None] * K
        if st.asynchronous and self.host_pages_per_layer > 0:
            wshape = (2, self.chunk_size // self.page_size, self.page_size, self.num_kv_heads, self.head_dim)
            self._wbuf_k = torch.empty(wshape, dtype=self.dtype, device=self.device)
            self._wbuf_v = torch.empty(wshape, dtype=self.dtype, device=self.device)
        else:
            self._wbuf_k = self._wbuf_v = None

    def _make_tile_state(self, stage_grain: str, kv_stash_mib: int) -> None:
        """The staging grain (head grain needs zero-copy access to the pinned host tier), the device mask of
        written-back gradient tiles, the device byte counters and the K/V stash's size."""
        L, H, Hkv, S, D = (self.num_layers, self.host_pages_per_layer, self.num_kv_heads, self.page_size,
                           self.head_dim)
        grain = stage_grain
        if grain == "head" and self._cuda and not self.segmented and H > 0 and not _zero_copy_works(self.k_host, self.k_cache):
            warnings.warn("this GPU cannot read the pinned host tier directly (zero-copy); sparse offload stages whole "
                          "pages of each selection instead of (page, KV head) tiles (stage_grain='page')")
            grain = "page"
        self.stage_grain = grain
        # Whole-layer staging: which host (page, KV head) dK/dV tiles hold a written-back gradient, on the
        # device (head-grained stagings read it without a host sync; every write-back updates it).
        self._written = (torch.zeros((L, H, Hkv), dtype=torch.bool, device=self.device)
                         if not self.segmented and H > 0 else None)
        # Device byte counters of head-grained copies: host->device, device->host, K/V restored from the stash.
        self._dev_bytes = torch.zeros(3, dtype=torch.int64, device=self.device) if self._written is not None else None
        # The K/V stash (package docstring): head-grained Stage-2 stagings of whole-layer staging only.
        C = (kv_stash_tiles(L, H, Hkv, D, S, self.dtype, kv_stash_mib << 20, self.staging_sets)
             if grain == "head" and not self.segmented else 0)
        self.kv_stash_tiles = C  # allocated when a needed_heads hook is set (sparse attention), not before

    @property
    def needed_heads(self):
        """The Stage-2 selection hook (see the class docstring); setting one allocates the K/V stash, if any."""
        return self._needed_heads

    @needed_heads.setter
    def needed_heads(self, hook) -> None:
        self._needed_heads = hook
        if hook is not None and self.kv_stash_tiles and self._stash_k is None:
            shape = (self.num_layers - self.staging_sets, self.kv_stash_tiles, self.page_size, self.head_dim)
            self._stash_k = torch.empty(shape, dtype=self.dtype, device=self.device)
            self._stash_v = torch.empty(shape, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ memory
    def _host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host tensor; page-locked on CUDA (see :func:`host_empty`)."""
        return host_empty(shape, dtype, self._cuda, self._host_pins)

    @staticmethod
    def pages_needed(num_layers: int, seq_len: int, page_size: int) -> int:
        """Logical pages (both tiers) for ``seq_len`` tokens over ``num_layers`` layers."""
        return num_layers * -(-seq_len // page_size)

    @property
    def nbytes(self) -> int:
        """GPU bytes of the store's page buffers: the pool (resident + staging, K, V, dK, dV), the own-gradient
        buffers and the write buffers. Block tables: :attr:`index_nbytes`."""
        tensors = [self.k_cache, self.v_cache, self.dk_cache, self.dv_cache]
        if self.own_dk_cache is not None:
            tensors += [self.own_dk_cache, self.own_dv_cache]
        if self._wbuf_k is not None:
            tensors += [self._wbuf_k, self._wbuf_v]
        if self._stash_k is not None:
            tensors += [self._stash_k, self._stash_v]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def index_nbytes(self) -> int:
        """GPU bytes of the int32 block tables (4 bytes per page of a layer, or per page with segments)."""
        tensors = [self.block_table] if self.block_table is not None else [self._first_tables, self._ramp]
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
        self._grad_extra: list[set[int]] = [set() for _ in range(L)]  # ... and for these pages (>= _grad_valid)
        self._runs_cache: dict[tuple[int, int], tuple[tuple[int, int], ...] | None] = {}
        K = self.staging_sets
        self._tag: list[_Tag | None] = [None] * K
        self._busy = [False] * K
        self._owner = [-1] * K  # layer whose use holds each staging set while busy
        self._pending: _Use | None = None
        self._inflight: dict[int, _Use] = {}
        self._seen_start: int | None = None
        self._seen_layers: set[int] = set()
        self._wbuf_next = 0
        self._seq_len: int | None = None
        self._stats = {"h2d_bytes": 0, "d2h_bytes": 0, "prefetched": 0, "on_demand": 0, "kv_stash_bytes": 0}
        self._pairs_cache: dict[tuple[int, int], tuple] = {}
        self._heads_used = [False] * L  # a head-grained write-back went into the layer's host dK/dV this step
        self._in_stage2 = False  # Stage 2 has begun this step (the Stage-1 shadow is gone: _begin_stage2)
        self._stash_key: list = [None] * self.num_layers  # chunk start of the K/V tiles layer l's stash holds
        if self._written is not None:
            self._written.zero_()
            self._dev_bytes.zero_()
        if self._sched is not None:
            self._sched.reset(None)
        if self.trace is not None:
            self.trace.clear()

    @property
    def stats(self) -> dict:
        """Bytes copied each way (``h2d_bytes``/``d2h_bytes``, head-grained tiles included), K/V bytes a backward
        took from the stash instead of the host (``kv_stash_bytes``) and stagings issued ahead (``prefetched``)
        or at the point of use (``on_demand``). Reading it after head-grained
        stagings waits for the copy streams (their byte counts are kept on the device)."""
        if self._dev_bytes is not None and any(self._heads_used):
            self._streams.synchronize()
            h2d, d2h, stash = self._dev_bytes.tolist()
            self._dev_bytes.zero_()
            self._stats["h2d_bytes"] += h2d
            self._stats["d2h_bytes"] += d2h
            self._stats["kv_stash_bytes"] += stash
        return self._stats

    @property
    def supports_saved_attention(self) -> bool:
        """Whether a step may skip the Stage-2 attention forwards (``save_attention``): with segmented
        staging the attention acquires each segment itself; whole-layer staging stages in the view."""
        return self.segmented

    def set_saved_attention(self, on: bool) -> None:
        """Tell the segment schedule whether this step's Stage-2 forwards of chunks 0..N-2 read the past
        (call after :meth:`begin_step`, before the step's first attention).

        Raises:
            RuntimeError: ``on`` with whole-layer staging (:attr:`supports_saved_attention` False).
        """
        if on and not self.segmented:
            raise RuntimeError("save_attention needs segmented staging (whole-layer staging stages in attention_view)")
        if self._sched is not None and self._sched.saved_attention != on:
            self._sched.saved_attention = on
            self._sched.reset(self._seq_len)

    def begin_step(self, seq_len: int) -> None:
        """Tell the store the step's length (bounds the prefetch of a next chunk)."""
        if not self.fits(seq_len):
            raise ValueError(f"{seq_len} tokens do not fit a store sized for {self.max_pages_per_layer * self.page_size}")
        self._seq_len = seq_len
        if self._sched is not None:
            self._sched.reset(seq_len)

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
        extra = self._grad_extra[layer]
        if extra:
            extra.difference_update([p for p in extra if p >= keep])
        for key in [key for key in self._runs_cache if key[0] == layer and key[1] >= start]:
            del self._runs_cache[key]
        for key in [key for key in self._pairs_cache if key[0] == layer and key[1] >= start]:
            del self._pairs_cache[key]
        R = self.resident_pages_per_layer
        if self._written is not None and keep - R < self.host_pages_per_layer:
            written = self._written
            self._streams.d2h_run(lambda: written[layer, max(0, keep - R):].fill_(False))
            self._wb_layer[layer] = self._d2h_event()
        if self._sched is not None:
            self._sched.release_from(layer, keep)
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
            if not self.stage1_shadow_pages:  # else Stage 2 zeroes all dK/dV when it begins (_begin_stage2)
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
                st.d2h_wait(st.record_compute())  # the buffer is filled
                st.d2h_copy_(hk, wk)
                st.d2h_copy_(hv, wv)
                st.record_d2h(self._wbuf_free[b])
                self._wb_layer[layer] = self._d2h_event()
            self._stats["d2h_bytes"] += 2 * nt * Hkv * D * k.element_size()
            Sh = self.stage1_shadow_pages
            if Sh and not self._in_stage2 and a < R + Sh:  # and into the Stage-1 shadow (compute stream)
                e1 = min(p1, R + Sh)
                ns = min(nt, (e1 - a) * S)
                s1 = self._shadow_base + layer * Sh + (a - R)
                self._k1[s1 : s1 + e1 - a].view(-1, Hkv, D)[:ns] = k[t0 : t0 + ns]
                self._v1[s1 : s1 + e1 - a].view(-1, Hkv, D)[:ns] = v[t0 : t0 + ns]
            if self.trace is not None:
                self.trace.append(("write_host", layer, a, p1))
        self._pages[layer] = p1
        if self._sched is not None:
            self._sched.stored[layer] = p1

    # ------------------------------------------------------ engine interface
    def attention_view(
        self, layer: int, stage: int, start: int, length: int, is_last: bool, q_doc_start: torch.Tensor | None = None
    ) -> PagedKV:
        """The paged state of (chunk at token ``start``, ``layer``), its pages staged on the GPU.

        Same contract as :meth:`PagedKVStore.attention_view`. With segmented staging the view stages
        nothing itself: its ``segments`` (:class:`~oomb.ops.paged_attention.PastSegments`) stage each
        segment when the attention acquires it and write its dK/dV back when its backward releases
        it; ``after_backward`` frees the own-gradient buffer. With whole-layer staging the view
        stages the layer's past, and in Stage 2 its ``after_backward`` writes the updated past
        dK/dV back to the host and readies the next layer.
        """
        S, L = self.page_size, self.num_layers
        past = start // S
        if self.trace is not None:
            self.trace.append(("view", stage, layer, start))
        if self.segmented:
            own = 0 if (stage == 1 or is_last) else -(-length // S)
            seg = _SegmentedPast(self, layer, start, own)
            after = functools.partial(self._sched.end_backward, layer, start) if stage == 2 else None
            return PagedKV(None, None, None, start, q_doc_start=q_doc_start, after_backward=after, segments=seg)
        table = self.block_table[layer]
        if stage == 1:
            use = self._stage1_use(layer, start, past)
            self._acquire(use)
            nxt = self._stage1_use(layer + 1, start, past) if layer + 1 < L else self._next_chunk_forward(start + length, False)
            self._prefetch(nxt)
            if self.stage1_shadow_pages and not self._in_stage2:
                return PagedKV(self._k1, self._v1, self._table1[layer, :past], start, q_doc_start=q_doc_start)
            return PagedKV(self.k_cache, self.v_cache, table[:past], start, q_doc_start=q_doc_start)
        if not self._in_stage2:
            self._begin_stage2()
        if self._seen_start != start:
            self._seen_start, self._seen_layers = start, set()
        recompute = layer in self._seen_layers  # per-layer checkpointing re-runs the forward in backward
        self._seen_layers.add(layer)
        own = 0 if is_last else -(-length // S)
        bwd = self._stage2_use(layer, start, past, own, True)  # what this view's backward reads
        grad = recompute or layer == L - 1  # the backward of this view comes next
        use = bwd if grad else _Use(layer, start, past, 0, False, bwd.pages)
        self._acquire(use)
        if grad:
            nxt = self._next_backward(bwd)
        elif layer + 1 == L - 1:  # the top layer's forward is followed by its backward: stage its dK/dV too
            nxt = self._stage2_use(layer + 1, start, past, own, True)
        else:
            nxt = self._stage2_use(layer + 1, start, past, 0, False)
        self._prefetch(nxt)
        own_table = None if is_last else table[past : past + own]
        return PagedKV(
            self.k_cache, self.v_cache, table[:past], start, self.dk_cache, self.dv_cache, own_table, q_doc_start,
            after_backward=functools.partial(self._after_backward, bwd),
        )

    def layer_block_table(self, layer: int, num_pages: int) -> torch.Tensor:
        """int32 [num_pages] GPU slots of the first ``num_pages`` pages of ``layer`` (resident or staging; a view).

        Raises:
            RuntimeError: with segmented staging (a layer's pages have no fixed slots then).
        """
        if self.segmented:
            raise RuntimeError("a store with segmented staging has no fixed per-layer block table (segment_pages='layer' has)")
        return self.block_table[layer, :num_pages]

    def after_attention_forward(self, layer: int, stage: int) -> None:
        """The attention forward of ``layer`` is enqueued: a K/V-only staging set may be refilled."""
        if self.segmented:
            # Every segment was released by the attention itself. After an attention with no host
            # segment (chunk 0, or a resident past) the next host use is staged now; not at the view,
            # which comes before Stage 1 writes this layer's pages.
            self._sched._prefetch()
            return
        use = self._inflight.get(layer)
        if use is not None and not use.grad:
            self._release(layer, self._streams.record_compute())

    # ------------------------------------------------------------------ tests
    def read_grad(self, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored dK/dV of tokens [start, start+n) of ``layer`` -> two [n, Hkv, D] tensors (synchronises)."""
        self._streams.synchronize()
        if self._cuda:
            torch.cuda.synchronize(self.device)
        S, R = self.page_size, self.resident_pages_per_layer
        out = []
        written = self._written.cpu() if self._written is not None else None
        for gpu, host in ((self.dk_cache, self.dk_host), (self.dv_cache, self.dv_host)):
            pages = []
            for p in range(start // S, -(-(start + n) // S)):
                if p < R:
                    pages.append(gpu[layer * R + p].cpu())
                elif written is not None:  # whole-layer staging tracks written tiles per (page, KV head)
                    keep = written[layer, p - R][None, :, None]
                    pages.append(torch.where(keep, host[layer, p - R], torch.zeros((), dtype=host.dtype)))
                elif self._host_grad_valid(layer, p):
                    pages.append(host[layer, p - R].clone())
                else:
                    pages.append(torch.zeros_like(host[layer, 0]))
            flat = torch.stack(pages).flatten(0, 1)
            off = start - (start // S) * S
            out.append(flat[off : off + n])
        return out[0], out[1]

    def _host_grad_valid(self, layer: int, page: int) -> bool:
        if self._sched is not None:
            return self._sched.page_valid(layer, page)
        return page < self._grad_valid[layer] or page in self._grad_extra[layer]

    def grad_written_pages(self, layer: int) -> int:
        """End of the pages [R, end) of ``layer`` whose host dK/dV hold a written-back gradient (0 if none)."""
        if self._sched is None:
            return self._grad_valid[layer]
        R = self.resident_pages_per_layer
        p = R
        while p < self.max_pages_per_layer and self._host_grad_valid(layer, p):
            p += 1
        return p if p > R else 0
