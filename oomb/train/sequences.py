"""Which sequence each rank trains at each step: epoch after epoch in a seeded order, sharded over ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Sample", "SequenceStream", "document_bounds"]


@dataclass(frozen=True)
class Sample:
    """One training sequence for :meth:`oomb.Engine.step`.

    Attributes:
        input_ids: int64 ``[1, T]``.
        labels: int64 ``[1, T]``, or ``None`` for ``input_ids`` themselves. The engine shifts them:
            ``labels[t + 1]`` is the target of position ``t``; ``-100`` there means no loss at ``t``.
        cu_seqlens: int64 ``[D + 1]``, the document bounds (0 first, ``T`` last): attention and positions
            restart at each bound and no target crosses one; ``None``: one causal stream.
    """

    input_ids: torch.Tensor
    labels: Optional[torch.Tensor] = None
    cu_seqlens: Optional[torch.Tensor] = None


def document_bounds(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``cu_seqlens`` of the documents in ``input_ids [1, T]`` (or ``[T]``): a document ends after each
    ``eos_id`` token.

    Returns an int64 CPU tensor ``[num_docs + 1]``: 0 first, ``T`` last, strictly increasing (an EOS as the
    last token ends the last document).
    """
    ids = input_ids.reshape(-1).cpu()
    ends = (torch.nonzero(ids[:-1] == eos_id).view(-1) + 1).tolist()
    return torch.tensor([0, *ends, ids.numel()], dtype=torch.int64)


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
