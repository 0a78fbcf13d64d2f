"""Stage-1 attention outputs kept for the Stage-2 recompute (``OOMBConfig.save_attention``).

In a chunk-recurrent step (docs/design.md §2.1) every chunk but the last runs its attention forward
twice: in Stage 1 (no grad, to produce the K/V of later layers) and again in the Stage-2
recompute, which needs the attention output ``out`` as the input of ``o_proj`` and
``(out, lse)`` for the attention backward. Both forwards read the same past pages with the
same q, k, v (the recompute repeats the same operations on the same inputs), so the Stage-2
forward only reproduces what Stage 1 computed. Keeping Stage 1's ``out`` [C, Hq, D] and
``lse`` [Hq, C] per (chunk, layer) skips it: one of the three attention passes over the
past (two forwards, one backward of ~2.5 forwards' work), ~22% of the attention FLOPs.

This is the trade selective activation checkpointing makes in full-sequence training
(torchtitan's "selective AC" keeps the outputs of the SDPA op and recomputes the rest):
memory for the attention's compute. Per token and layer it costs ``Hq * D`` values in the
model dtype plus ``Hq`` float32 log-sum-exps: 7,280 bytes for the Qwen2.5-7B shape in bf16,
3.5x the token's K/V; 24.1 GiB at 128K tokens over 28 layers (every chunk but the last).

Where they are kept:

* ``"gpu"``: one device buffer for the whole step.
* ``"host"``: page-locked host memory. Stage 1 copies each (chunk, layer) out on a copy
  stream (overlapped with the next layer's compute); Stage 2 fetches the next chunk's
  outputs, all layers at once, into one of two device staging buffers while the current
  chunk runs. The device holds 2 chunks x layers of outputs (1.6 GiB for the shape above).

The gradients are those of the recompute path: the backward sees bitwise the out and lse
the recompute would have produced (tests check equality with ``save_attention="off"``).
With per-layer checkpointing the rerun of each layer reuses them too; the last chunk's
(no Stage-1 forward) come from :mod:`oomb.engine.kept_attention`.
"""

from __future__ import annotations

import weakref

import torch

from .offload.layout import host_empty, unregister_host

__all__ = ["SAVE_ATTENTION_CHOICES", "SavedAttention"]

SAVE_ATTENTION_CHOICES = ("off", "gpu", "host")


class SavedAttention:
    """The Stage-1 ``(out, lse)`` of every (chunk, layer) of one step, for the Stage-2 recompute.

    Args:
        where: "gpu" or "host" (see the module docstring).
        num_layers: decoder layers.
        num_chunks: chunks of the step; chunks ``0 .. num_chunks - 2`` are saved (the last one
            has no Stage-1 forward).
        device: the compute device. On a CPU device "host" keeps everything in (pageable)
            memory and copies synchronously; the data path is the same.

    Buffers are allocated at the first :meth:`save` (their layout follows that ``out``'s strides,
    so the backward reads the same layout the recompute would give it) and reused by later steps
    with the same shapes.
    """

    def __init__(self, where: str, num_layers: int, num_chunks: int, device: torch.device) -> None:
        if where not in ("gpu", "host"):
            raise ValueError(f"save_attention must be 'gpu' or 'host' here, got {where!r}")
        self.where = where
        self.num_layers = num_layers
        self.num_chunks = num_chunks
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._key = None  # (out shape, out strides, dtype, lse shape, lse strides)
        self._out = self._lse = None  # [chunks, L, n_out] / [chunks, L, n_lse] (device for gpu, host for host)
        self._stage_out = self._stage_lse = None  # host: [2, L, n] device staging
        self._staged = [None, None]  # host: chunk held by each staging slot
        self._events: list = [None, None]
        self._pins: list[int] = []
        self._stream = torch.cuda.Stream(self.device) if self._cuda and where == "host" else None

    @property
    def nbytes(self) -> dict[str, int]:
        """Bytes allocated: ``{"gpu": ..., "host": ...}``."""
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None)  # noqa: E731
        main = size([self._out, self._lse])
        if self.where == "gpu":
            return {"gpu": main, "host": 0}
        return {"gpu": size([self._stage_out, self._stage_lse]), "host": main}

    # ------------------------------------------------------------------ layout
    @staticmethod
    def _view(flat: torch.Tensor, shape, strides) -> torch.Tensor:
        return torch.as_strided(flat, shape, strides)

    def _allocate(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        for name, t in (("out", out), ("lse", lse)):
            if not _dense(t):
                raise ValueError(f"attention {name} must be a dense tensor to be saved, got strides {t.stride()}")
        key = (tuple(out.shape), out.stride(), out.dtype, tuple(lse.shape), lse.stride(), lse.dtype)
        if self._key == key:
            return
        self._key = key
        n, L = self.num_chunks - 1, self.num_layers
        if self.where == "gpu":
            self._out = torch.empty((n, L, out.numel()), dtype=out.dtype, device=self.device)
            self._lse = torch.empty((n, L, lse.numel()), dtype=lse.dtype, device=self.device)
            return
        self._out = self._lse = None  # free before allocating anew
        self._out = host_empty((n, L, out.numel()), out.dtype, self._cuda, self._pins)
        self._lse = host_empty((n, L, lse.numel()), lse.dtype, self._cuda, self._pins)
        if self._pins:
            fin = weakref.finalize(self, unregister_host, list(self._pins), [self._out, self._lse])
            fin.atexit = False
            self._pins = []
        self._stage_out = torch.empty((2, L, out.numel()), dtype=out.dtype, device=self.device)
        self._stage_lse = torch.empty((2, L, lse.numel()), dtype=lse.dtype, device=self.device)
        self._staged = [None, None]

    def _views(self, out_flat: torch.Tensor, lse_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        oshape, ostride, _, lshape, lstride, _ = self._key
        return self._view(out_flat, oshape, ostride), self._view(lse_flat, lshape, lstride)

    # ------------------------------------------------------------------ Stage 1
    def save(self, chunk: int, layer: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Keep Stage 1's ``out`` [C, Hq, D] and ``lse`` [Hq, C] of (chunk, layer); chunk < num_chunks - 1."""
        self._allocate(out, lse)
        # The buffers hold each tensor's memory as it is (the layout of _key), so the host copies are plain
        # contiguous byte copies: a copy between a strided device view and a strided host view (HF hands the
        # attention [Hq, C, D] memory seen as [C, Hq, D]) goes through a temporary and a host-side strided copy,
        # synchronous, which made 'host' 15% slower than not saving at all on the H200.
        o_src, l_src = _memory_order(out), _memory_order(lse)
        if self._stream is None:
            self._out[chunk, layer].copy_(o_src)
            self._lse[chunk, layer].copy_(l_src)
            return
        # Host copy on the side stream once the compute stream has produced out/lse; the caching
        # allocator must not hand their memory to another tensor before the copy has read it.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._out[chunk, layer].copy_(o_src, non_blocking=True)
            self._lse[chunk, layer].copy_(l_src, non_blocking=True)
        out.record_stream(self._stream)
        lse.record_stream(self._stream)

    # ------------------------------------------------------------------ Stage 2
    def prefetch(self, chunk: int) -> None:
        """Host: start fetching every layer's outputs of ``chunk`` into a staging slot (no-op for "gpu",
        a negative chunk, or one already staged). Call it once the previous user of that slot (chunk + 2)
        has been enqueued completely."""
        if (self.where != "host" or not 0 <= chunk < self.num_chunks - 1 or self._out is None
                or self._staged[chunk % 2] == chunk):
            return
        slot = chunk % 2
        self._staged[slot] = chunk
        if self._stream is None:
            self._stage_out[slot].copy_(self._out[chunk])
            self._stage_lse[slot].copy_(self._lse[chunk])
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._stage_out[slot].copy_(self._out[chunk], non_blocking=True)
            self._stage_lse[slot].copy_(self._lse[chunk], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        self._events[slot] = ev

    def load(self, chunk: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 1's ``(out, lse)`` of (chunk, layer), on the device, in the layout they were saved with.

        The tensors are views of the step's buffers: valid until chunk ``chunk - 2`` is prefetched
        ("host") or the next step ("gpu"); do not modify them.

        Raises:
            RuntimeError: if nothing was saved for that chunk (a bug in the caller).
        """
        if self._out is None or not 0 <= chunk < self.num_chunks - 1:
            raise RuntimeError(f"no saved attention output for chunk {chunk} (saved: chunks 0..{self.num_chunks - 2})")
        if self.where == "gpu":
            return self._views(self._out[chunk, layer], self._lse[chunk, layer])
        slot = chunk % 2
        if self._staged[slot] != chunk:
            self.prefetch(chunk)
        if self._events[slot] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._events[slot])
            self._events[slot] = None
        return self._views(self._stage_out[slot, layer], self._stage_lse[slot, layer])

    def begin_step(self) -> None:
        """A new step starts: the staging slots hold nothing of it."""
        self._staged = [None, None]
        self._events = [None, None]


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements as a flat contiguous view, in memory order (what ``_view`` turns back)."""
    return torch.as_strided(t, (t.numel(),), (1,))


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: some permutation of the dims is contiguous."""
    order = sorted(range(t.dim()), key=lambda d: t.stride(d))
    expected = 1
    for d in order:
        if t.shape[d] != 1 and t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True
