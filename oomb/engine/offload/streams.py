"""The copy streams of an offloaded KV store: CUDA side streams with events, or synchronous copies on the CPU.

Every copy and every ordering of :class:`~oomb.engine.offload.OffloadedKVStore` goes through one of these two
classes, so tests can substitute simulated streams that defer each copy as long as the events allow.
"""

from __future__ import annotations

import torch

__all__ = ["make_streams"]


class _CudaStreams:
    """The two copy streams (host->device ``copy``, device->host ``d2h``) and the events that order them
    against the compute (current) stream and each other."""

    asynchronous = True

    def __init__(self, device: torch.device, copy_streams: int = 2) -> None:
        self.device = device
        self.copy = torch.cuda.Stream(device)
        # copy_streams=1 puts both directions on one stream (serialised; for A/B measurements and debugging).
        # The events are the same either way.
        self.d2h = self.copy if copy_streams == 1 else torch.cuda.Stream(device)

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

    def d2h_wait(self, ev: torch.cuda.Event) -> None:
        self.d2h.wait_event(ev)

    def d2h_copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)

    def record_d2h(self, ev: torch.cuda.Event) -> None:
        ev.record(self.d2h)

    def h2d_run(self, fn) -> None:
        """Enqueue ``fn``'s work (kernels, e.g. a zero-copy gather) on the host->device stream."""
        with torch.cuda.stream(self.copy):
            fn()

    def h2d_alloc(self, fn) -> None:
        """Run ``fn`` now, allocating (``torch.empty`` only) from the host->device stream's memory."""
        with torch.cuda.stream(self.copy):
            fn()

    def h2d_keep(self, *tensors: torch.Tensor) -> None:
        """``tensors`` (made on another stream) stay allocated until the host->device work enqueued next has run."""
        for t in tensors:
            t.record_stream(self.copy)

    def d2h_run(self, fn, *tensors: torch.Tensor) -> None:
        """Enqueue ``fn``'s work on the device->host stream; ``tensors`` (made on another stream) stay
        allocated until it has run."""
        with torch.cuda.stream(self.d2h):
            fn()
        for t in tensors:
            t.record_stream(self.d2h)

    def synchronize(self) -> None:
        self.copy.synchronize()
        self.d2h.synchronize()


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

    def d2h_wait(self, ev) -> None:
        pass

    def d2h_copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record_d2h(self, ev) -> None:
        pass

    def h2d_run(self, fn) -> None:
        fn()

    def h2d_alloc(self, fn) -> None:
        fn()

    def h2d_keep(self, *tensors) -> None:
        pass

    def d2h_run(self, fn, *tensors) -> None:
        fn()

    def synchronize(self) -> None:
        pass


def make_streams(device: torch.device, copy_streams: int = 2):
    """Streams for a store on ``device``: :class:`_CudaStreams` with ``copy_streams`` (1 or 2) side streams on CUDA,
    else :class:`_SyncStreams`."""
    return _CudaStreams(device, copy_streams) if device.type == "cuda" else _SyncStreams()
