"""How many chunks' autograd graphs a step can keep from Stage 1 to Stage 2 (``OOMBConfig.keep_graphs='auto'``).

A kept chunk runs its Stage-1 forward with autograd and holds the graph until its turn in Stage 2, which then
calls its backward without recomputing it. The graphs are held together at the end of Stage 1, on top of what
a step needs anyway, so the count is what fits in the GPU memory a step leaves free: the bytes of one chunk's
graph and the step's peak above its start are read on the steps before (CUDA allocator counters), and a length
longer than any measured keeps none until it has been measured.
"""

from __future__ import annotations

from ..memory import allocator_reserve_bytes

__all__ = ["GraphBudget"]


class GraphBudget:
    """Per-engine record of the memory kept graphs need, and the count that fits.

    Attributes:
        bytes_per_token: bytes one chunk's graph holds per token (the last chunk's Stage-2 forward, its loss
            included), the most measured; None before the first measurement.
        work: (tokens, bytes) of the longest sequence measured: the step's peak allocation above its start, less
            the graphs it kept; None before the first step.
    """

    def __init__(self) -> None:
        self.bytes_per_token: float | None = None
        self.work: tuple[int, int] | None = None

    def note_graph(self, tokens: int, nbytes: int) -> None:
        """One chunk of ``tokens`` tokens held ``nbytes`` bytes of graph after its forward."""
        if tokens > 0 and nbytes > 0:
            per = nbytes / tokens
            self.bytes_per_token = per if self.bytes_per_token is None else max(self.bytes_per_token, per)

    def note_step(self, tokens: int, peak: int, start: int, kept: int, chunk_size: int) -> None:
        """A step of ``tokens`` tokens peaked at ``peak`` bytes allocated from ``start`` at its beginning, with
        ``kept`` chunk graphs of ``chunk_size`` tokens held."""
        work = peak - start - kept * self.chunk_bytes(chunk_size)
        if self.work is None or tokens > self.work[0]:
            self.work = (tokens, max(work, 0))
        elif tokens == self.work[0]:
            self.work = (tokens, max(self.work[1], work))

    def chunk_bytes(self, chunk_size: int) -> int:
        """Bytes of one kept chunk's graph (0 before a measurement)."""
        return 0 if self.bytes_per_token is None else int(self.bytes_per_token * chunk_size)

    def chunks(self, tokens: int, chunk_size: int, free_bytes: int, total_bytes: int, most: int) -> int:
        """How many chunk graphs of ``chunk_size`` tokens fit in ``free_bytes`` (free now, the allocator's cache
        included) for a step of ``tokens`` tokens, at most ``most``; 0 for a length longer than measured."""
        graph = self.chunk_bytes(chunk_size)
        if graph <= 0 or self.work is None or tokens > self.work[0] or most <= 0:
            return 0
        spare = free_bytes - self.work[1] - allocator_reserve_bytes(total_bytes)
        return max(0, min(most, spare // graph))
