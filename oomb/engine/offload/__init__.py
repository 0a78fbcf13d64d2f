"""Two-tier KV page store: GPU-resident pages plus pinned host pages staged on a side stream.

docs/design.md §2.3. A drop-in for :class:`~oomb.engine.kv_store.PagedKVStore` (same
engine interface) for sequences whose K/V and dK/dV do not fit on the GPU.

**Layout.** Page ``p`` of layer ``l`` (tokens ``p*S .. p*S+S-1``) lives

* on the GPU, in resident slot ``l * R + p``, when ``p < R`` (the first ``R``
  pages of EVERY layer are resident), else
* in host memory at ``k_host[l, p - R]`` (pinned on CUDA), and is copied into a
  staging buffer of the GPU pool when an attention needs it.

The GPU pool is ``[L*R resident pages | K*W staging slots]``: ``K`` staging
buffers of ``W`` pages (two with segments; with whole-layer staging
:func:`~oomb.memory.tiering.choose_staging_sets` takes up to four when the pool affords them).
Host pages of one layer are contiguous, so a staging is one copy per tensor
(K, V, dK, dV), never one copy per page.

**Segments (default).** The attention takes a layer's past in segments
(:mod:`oomb.ops.paged_attention`, "Segmented past": one kernel call per segment,
merged by log-sum-exp; the backward runs the segments in reverse with the final
lse), so staging holds one segment, not a layer: ``W = min(SP, n - R)`` for a
segment of ``SP`` pages (``segment_pages``; default 32K tokens, 256 pages of
128). For a past of ``P > R`` pages, segment 0 is pages ``[0, min(P, R+SP))``
(the resident prefix read in place plus the first ``SP`` host pages), segment
``i >= 1`` is ``[R + i*SP, min(P, R + (i+1)*SP))``; a past within ``R`` is one
resident segment. Each acquire hands the attention a block table for the buffer
the segment was staged into (a fixed table per buffer for segment 0, a view of
one int32 ramp for the others), so buffers can alternate freely. With a single
segment the kernel calls are exactly the unsegmented ones (bitwise). The
chunk's own stored dK/dV (backward only) go through two small own-gradient
buffers of one chunk each.

``segment_pages='layer'`` keeps whole-layer staging (``W = n - R``, ``K`` staging
sets, set ``l % K`` for layer ``l``, a block table fixed for the step), which the
sparse attention needs (it reads the past through one table). ``K`` is 2 to 4
(:func:`~oomb.memory.tiering.choose_staging_sets`); with segments it is 2.

**Why the earliest pages are resident.** Page ``p`` is read by every later
chunk, so the earliest pages are read most often: keeping a prefix of every
layer on the GPU removes the most traffic per resident byte and cuts the
traffic of every layer alike (so no layer's copy becomes the one the compute
waits for). A GPU budget of ``G`` pages buys the largest ``R`` with
``L*R + K*W <= G`` (:func:`~oomb.memory.tiering.resident_pages_for_budget`).

**GPU bytes** = ``(L*R + K*W)`` pages of K, V, dK, dV + two one-chunk own-gradient
buffers (dK, dV) + two one-chunk K/V write buffers + int32 block tables (4 bytes
per page of a layer). With segments nothing but the tables depends on the
context length: Qwen2.5-7B (28 layers, 4 KV heads, head dim 128, bf16 K/V, fp32
dK/dV, page 128, chunk 4096, R = 0) holds 2 x 256 pages x 768 KiB = 384 MiB of
staging + 32 MiB own-gradient + 16 MiB write buffers = 432 MiB at any length,
plus ~312 bytes of table per 10K tokens. (Whole-layer staging grows by ``K``
layers' pages per token: 12 KiB/token per set, ~126 MB per 10K tokens.)

**Schedule, segmented** (:class:`~oomb.memory.schedule.SegmentSchedule`; L layers, chunk c)::

    Stage 1, chunk c, layer l:  write the chunk's new K/V (resident slots, or owned GPU buffer -> host, D2H);
                                segments 0..k-1 of l's past in order, each staged one segment ahead
    Stage 2 fwd, layer l:       segments 0..k-1 of l (the first two of layer 0 are still staged from the
                                backward of chunk c+1)
    [checkpointing that reruns the attention (checkpoint_attention='recompute'): the recompute of layer l
     before its backward: segments 0..k-1 again; with 'keep' the rerun reads no past]
    Stage 2 bwd, layer l:       own dK/dV staged (one backward ahead); segments k-1..0 with their dK/dV
                                (the last two are the forward's, their dK/dV added in place); after each
                                segment's backward its dK/dV are written back (D2H) before the buffer is reused

The next segment use is predicted from the engine's order (the schedule re-finds
its place if the engine departs from it) and staged into the buffer no kernel
is reading while the current segment computes; the next layer's first segment
is staged during the current layer's last. A prefetch never reads pages Stage 1
has not written yet. Host dK/dV pages are never zeroed on the host: a page whose
gradient was never written back is zero-filled in its staging slot instead of
copied. :func:`~oomb.memory.traffic.segment_traffic` counts the bytes of this schedule (the planner's
traffic).

**Schedule, whole-layer** (``segment_pages='layer'``; P past pages)::

    Stage 1, chunk c, layer l:   use K/V[0:P] of l;      prefetch K/V of l+1 (or layer 0 of chunk c+1)
                                 write the chunk's new K/V: resident slots, or owned GPU buffer -> host (D2H)
    Stage 2 fwd, layer l < L-1:  use K/V of l;           prefetch K/V of l+1
    Stage 2 fwd, layer L-1:      use K/V+dK/dV of L-1 (its backward is next); prefetch K/V+dK/dV of L-2
    Stage 2 bwd, layer l:        use K/V+dK/dV of l (incl. the chunk's own dK/dV pages);
                                 after its backward: write back dK/dV[0:P] (D2H), prefetch layer l-2 (or
                                 K/V of layer 0 of chunk c-1)

With per-layer checkpointing the recompute asks for a layer again right before
its backward; that view finds the pages already staged.

**Stage-1 shadow (whole-layer staging).** Stage 1 computes no gradient, so the
pool's dK/dV bytes (twice the K/V bytes for bf16 K/V and fp32 gradients) are
idle until Stage 2 begins. Stage 1 keeps the K/V of host pages ``[R, R + Sh)``
of every layer there too: each Stage-1 write of such a page also goes into its
shadow slot (a device copy; the D2H copy to the host tier, which Stage 2 reads,
is unchanged), and Stage-1 attention reads those pages in place through a
second block table over one view of the K (V) and dK (dV) bytes (K and dK share
one allocation), so Stage 1 stages only pages ``[R + Sh, P)``. ``Sh`` is
:func:`~oomb.memory.tiering.stage1_shadow_pages`: all host pages when they fit (Qwen2.5-7B at 1M
tokens on an H200: 3,876 of 3,876 per layer), else a prefix of them (``stage1_shadow_partial``,
default on; bitwise equal to no shadow on CPU and on an H200). The first
Stage-2 view zeroes every dK/dV page (which also clears the resident pages'
gradients that Stage-1 writes otherwise zero) before any staging into them.
``stage1_shadow=False`` turns it off.

**Sparse attention, page grain (``stage_grain='page'``): only the selected pages in Stage 2.** A sparse (chunk, layer)
reads only the past pages of its selection (made in Stage 1, reused unchanged in
Stage 2). The engine gives the store a hook, :attr:`OffloadedKVStore.needed_pages`
``(layer, start) -> sorted list of logical past pages | None``: the union of the
selection's pages over blocks and heads (sink and local pages are part of it; page 0
too where a row is padded, since the PyTorch reference gathers padding from page 0
before masking it; every page for a dense selection), copied to pinned host memory
in Stage 1 so Stage 2 reads it without a device sync. None (unknown: Stage 1, the
last chunk, dense attention) stages the whole layer as above. With a list, the
Stage-2 uses of that (chunk, layer) copy K/V, and dK/dV, only of the needed host
pages (one copy per run of consecutive pages per tensor) plus the chunk's own
gradient pages, into the SAME slots (the block table does not change; other slots
hold whatever they held, and no kernel reads them), and after the backward write
back dK/dV of the needed pages only. Whether a host gradient page was ever written
back is tracked per page, so a needed page never written is zero-filled. The events
are the same as for whole layers. This Stage-2 traffic is data-dependent (the size
of the unions) and bounded by the whole-layer traffic that
:func:`oomb.memory.traffic.offload_traffic` estimates; equal when every selection is dense.

**Sparse attention: only the selected (page, KV head) tiles (default, ``stage_grain='head'``).** A
selection is per (query block, KV head), so a page is often read by one head only. With a
:attr:`OffloadedKVStore.needed_heads` hook (``(layer, start) -> page_idx | None``, the selection on
the device), a Stage-2 use of a (chunk, layer) moves only the tiles ``(page, head)`` that some
query block of that head selected (plus page 0 where a row is padded, and all heads of the chunk's
own gradient pages): K/V and dK/dV in, dK/dV back. The tile list is made on the host->device
stream from the selection (:func:`oomb.ops.page_gather.head_pairs`, no host sync), and the copies
are Triton kernels that read and write the pinned host tier directly (zero-copy;
:mod:`oomb.ops.page_gather`), run on the two copy streams with the same events as copies. Which
host tiles hold a written-back gradient is a device mask per (layer, page, head) that every
write-back updates; a never-written tile is zero-filled. Write-backs go out in pieces with an
event each, and the next dK/dV gather into the set follows them piece by piece. On an H200 the
kernels move 47 (in) / 48 (out) GB/s alone but only ~58 GB/s together (DMA: 55 / 55 / 92), and
the 1M-token step moved 75% fewer Stage-2 bytes than with whole layers. ``stage_grain='page'`` (or a GPU
that cannot address pinned memory) uses the page unions above.

**K/V stash (head grain; opt-in: ``kv_stash_mib``).** With ``K`` staging sets, a layer
``l < L - K`` loses its set to layer ``l + K`` between its Stage-2 forward and its backward, so the
backward reads the same K/V tiles over PCIe a second time (per selected host tile and chunk: K/V in for
the forward, K/V in again for the backward, dK/dV in and out; the K/V re-read is a quarter of the
host->device bytes). A stash of ``C`` tiles per layer (:func:`~oomb.memory.tiering.kv_stash_tiles`; ``[L - K, C, S, D]`` for K
and for V on the GPU) keeps the first ``C`` tiles of each forward's list
(:func:`~oomb.ops.page_gather.stash_head_tiles`, a device copy on the host->device stream right after
the gather); the backward use of that (chunk, layer), whose list begins with the same past tiles, puts
them back (:func:`~oomb.ops.page_gather.unstash_head_tiles`) and reads only the rest from the host
(``gather_head_pages(first=C)``). Every stash copy runs on the host->device stream, in issue order
with the stagings that read and refill it, so it needs no event of its own. ``stats['kv_stash_bytes']``
counts the bytes restored. The stash is allocated when the engine sets a ``needed_heads`` hook (sparse
attention), not for dense runs. The last chunk's forwards read whole-layer prefetches (its selection
does not exist yet when they are issued), so they fill no stash. The stash takes GPU memory that could
hold resident pages instead; the planners keep the requested MiB free for sparse runs.

**Ordering.** Copies run on two side CUDA streams, host->device (H2D) and
device->host (D2H), each in issue order; PCIe is full duplex, so a write-back
can overlap the next staging. Before a copy overwrites a staging buffer it
waits on an event the compute stream recorded after the last kernel that reads
it; before a kernel reads a buffer the compute stream waits on the event
recorded after the copy into it; a D2H write-back waits on an event recorded
after the kernels that produced the data. Between the two copy streams: an H2D
copy of dK/dV into a buffer waits for the last write-back out of it (its K/V
copies need not: a write-back reads only dK/dV slots), and an H2D copy reading
host pages of a layer waits for the last D2H copy into that layer's host pages
(Stage-1 writes and write-backs). New K/V of Stage 1 go through two owned GPU
buffers (the compute stream waits for the previous D2H out of a buffer before
refilling it), so no tensor of the autograd graph is ever read by a copy
stream. Host-side waits are never used for ordering. With whole-layer staging
the write-back of layer l and the staging of layer l-2 share a set: the
write-back goes out in ``writeback_pieces`` (8) pieces with an event each, and
each dK/dV copy of the staging waits only for the piece that read its slots, so
the staging follows the write-back piece by piece and both directions stay busy.
``copy_streams=1`` puts both directions on one stream (serialised; for A/B
measurements and debugging).

On CPU there are no streams: every copy runs synchronously where it is issued,
with the same schedule, so CPU tests check page placement, prefetch order and
lifetimes, and losses/gradients against PagedKVStore's. The stream calls go
through ``_CudaStreams`` / ``_SyncStreams`` (:mod:`.streams`); tests substitute two simulated copy
streams that defer every copy as long as the events allow, which turns a
missing wait (compute-side, or between the copy streams) into wrong numbers on CPU.

**Files.** :mod:`.store` (:class:`OffloadedKVStore`: construction, writes, views, the engine interface),
:mod:`.layout` (pool and host-tier allocation, pinning, block tables), :mod:`.uses` (what a use needs and a set
holds), :mod:`.whole_layer` (whole-layer staging), :mod:`.head_tiles` (tile-grain staging and the K/V stash),
:mod:`.segmented` (segment staging), :mod:`.ordering` (the events between the copy streams), :mod:`.streams`
(CUDA and synchronous copy streams). The sizes come from :mod:`oomb.memory.tiering`.
"""

from .layout import host_empty
from .store import OffloadedKVStore

__all__ = ["OffloadedKVStore", "host_empty"]
