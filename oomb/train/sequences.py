"""Which sequence each rank trains at each step: epoch after epoch in a seeded order, sharded over ranks."""

from __future__ import annotations

from ..data.sequences import Sample, document_bounds

__all__ = ["Sample", "SequenceStream", "document_bounds", "sample_bounds"]


def sample_bounds(sample: Sample, document_mask: bool, eos_token_id: int | None):
    """The ``cu_seqlens`` a sample trains (and is evaluated) with: its own, else (``document_mask``) a document ends
    after each ``eos_token_id`` token, else ``None`` (one stream)."""
    if sample.cu_seqlens is not None or not document_mask:
        return sample.cu_seqlens
    return document_bounds(sample.input_ids, eos_token_id)


class SequenceStream:
    """Sequence number ``g`` (0-based, over the whole run) of a sequence source: epoch after epoch, each in
    the source's seeded order.

    Rank ``r`` of ``W`` ranks with ``K`` sequences per rank and step trains, at step ``s`` (from 1), the
    numbers ``((s - 1) * K + j) * W + r`` for ``j < K``: a run is sharded deterministically and a resumed run
    sees the same sequences.

    Args:
        sequences: ``len()``, ``order(epoch) -> permutation of range(len)`` and ``[i]`` giving a
            :class:`Sample` or an int64 tensor ``[1, T]`` (e.g. :class:`oomb.data.TokenSequences`).
    """

    def __init__(self, sequences) -> None:
        self.sequences = sequences
        self._orders: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, g: int) -> Sample:
        epoch, i = divmod(g, len(self.sequences))
        if epoch not in self._orders:
            self._orders = {epoch: self.sequences.order(epoch)}
        item = self.sequences[int(self._orders[epoch][i])]
        return item if isinstance(item, Sample) else Sample(item)

    def of_step(self, step: int, per_rank: int, rank: int = 0, world_size: int = 1) -> list[Sample]:
        """The ``per_rank`` samples rank ``rank`` trains at ``step`` (from 1)."""
        return [self[((step - 1) * per_rank + j) * world_size + rank] for j in range(per_rank)]
