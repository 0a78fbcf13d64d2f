"""What the training loop reads: one :class:`Sample` per sequence, in a seeded order.

:class:`TokenSequences` cuts one token stream into consecutive ``seq_len``-token sequences (plain text);
:class:`TextSequences` serves them as samples (their documents split at EOS when asked);
:class:`oomb.data.packing.PackedSequences` serves examples packed with their own labels and bounds. Both have
``__len__``, ``order(epoch)``, ``__getitem__(i) -> Sample``, ``stats`` and ``digest()``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np
import torch

from .errors import DataError
from .stats import DataStats

__all__ = ["Sample", "TextSequences", "TokenSequences", "TrainingData", "document_bounds", "seeded_order"]


@dataclass(frozen=True)
class Sample:
    """One training sequence, as :meth:`oomb.Engine.step` takes it.

    ``input_ids``: int64 ``[1, T]``. ``labels``: int64 ``[1, T]`` aligned with ``input_ids`` (the engine shifts
    them: ``labels[t + 1]`` is the target of position ``t``), -100 where no loss is taken; None: the input ids
    themselves. ``cu_seqlens``: int64 ``[D + 1]`` bounds of the ``D`` documents (examples) in the sequence (0
    first, T last): attention and positions restart at each, and no loss crosses one; None: one stream.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None


class TrainingData(Protocol):
    """The training loop's view of the data."""

    stats: DataStats

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> Sample: ...

    def order(self, epoch: int) -> np.ndarray: ...

    def digest(self) -> str: ...


def seeded_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of ``range(n)`` of ``epoch`` (0-based) drawn from ``seed``: ``default_rng([seed, epoch])``."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def document_bounds(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``cu_seqlens`` of the documents in ``input_ids [1, T]`` (or ``[T]``): a document ends after each
    ``eos_id`` token.

    Returns an int64 CPU tensor ``[num_docs + 1]``: 0 first, ``T`` last, strictly increasing (an EOS as the
    last token ends the last document).
    """
    ids = input_ids.reshape(-1).cpu()
    ends = (torch.nonzero(ids[:-1] == eos_id).view(-1) + 1).tolist()
    return torch.tensor([0, *ends, ids.numel()], dtype=torch.int64)


class TokenSequences:
    """Consecutive ``seq_len``-token sequences of one token stream, served in a seeded order.

    Sequence ``i`` is ``tokens[i * seq_len : (i + 1) * seq_len]``. :meth:`batches`
    yields them in a random order drawn from ``seed``, and reshuffles with a new
    draw (``seed + epoch``) each time every sequence has been served, so a run
    with the same data, seq_len and seed sees the same sequences in the same order.

    Raises:
        DataError: ``seq_len`` < 2, or the stream is shorter than 2 tokens or
            than ``seq_len``; the message says how many tokens there are.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0) -> None:
        n = int(tokens.shape[0])
        if seq_len < 2:
            raise DataError(f"--seq-len is {seq_len}", "a training sequence needs at least 2 tokens (one input, one target); pass --seq-len 2 or more")
        if n < 2:
            raise DataError(f"the data has only {n} token(s)", "a training sequence needs at least 2 tokens; give more text")
        if n < seq_len:
            raise DataError(
                f"the data has {n:,} tokens, fewer than --seq-len {seq_len:,}",
                f"give more text or pass --seq-len {n} or less",
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.num_sequences = n // seq_len

    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, i: int) -> torch.Tensor:
        """Sequence ``i`` as an int64 tensor ``[1, seq_len]``."""
        if not 0 <= i < self.num_sequences:
            raise IndexError(i)
        chunk = self.tokens[i * self.seq_len : (i + 1) * self.seq_len]
        return torch.from_numpy(np.array(chunk, dtype=np.int64)).view(1, -1)  # a copy: the stream may be a read-only map

    def order(self, epoch: int) -> np.ndarray:
        """The seeded permutation of sequence indices for ``epoch`` (0-based)."""
        return seeded_order(self.num_sequences, self.seed, epoch)

    def batches(self, steps: int) -> Iterator[torch.Tensor]:
        """Yield ``steps`` sequences ``[1, seq_len]``, epoch after epoch, each epoch in its seeded order."""
        served = 0
        epoch = 0
        while served < steps:
            for i in self.order(epoch):
                if served >= steps:
                    return
                yield self[int(i)]
                served += 1
            epoch += 1


class TextSequences:
    """The sequences of a :class:`TokenSequences` as :class:`Sample` objects: labels None (every token is a
    target) and, with ``eos_id`` (``document_mask``), cu_seqlens that end a document after each EOS token.
    ``documents``: how many documents the stream joins; ``separator``: the id between them (default ``eos_id``),
    for :attr:`example_lengths`."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0, eos_id: int | None = None,
                 documents: int = 0, separator: int | None = None) -> None:
        self.sequences = TokenSequences(tokens, seq_len, seed)
        self.tokens = tokens
        self.seq_len = seq_len
        self.eos_id = eos_id
        self._lengths = None
        self.separator = eos_id if separator is None else separator
        n = len(self.sequences)
        used = tokens[: n * seq_len]
        starts = 0 if eos_id is None else int(np.count_nonzero(used.reshape(n, seq_len)[:, :-1] == eos_id))
        self.stats = DataStats(
            format="text", examples=documents, tokens=int(tokens.shape[0]), sequences=n, seq_len=seq_len,
            trained_tokens=n * (seq_len - 1) - starts, padding=0, dropped_tokens=int(tokens.shape[0]) - n * seq_len,
            split_examples=0, dropped_examples=0)

    def __len__(self) -> int:
        return len(self.sequences)

    def order(self, epoch: int) -> np.ndarray:
        return self.sequences.order(epoch)

    def __getitem__(self, i: int) -> Sample:
        ids = self.sequences[i]
        return Sample(ids, None, document_bounds(ids, self.eos_id) if self.eos_id is not None else None)

    @property
    def example_lengths(self) -> np.ndarray:
        """Tokens of each document (int64; the stream split after each EOS token, the EOS counted)."""
        if self._lengths is None:
            sep = self.separator
            ends = np.flatnonzero(self.tokens == sep) + 1 if sep is not None else np.zeros(0, np.int64)
            bounds = np.concatenate([[0], ends[ends < len(self.tokens)], [len(self.tokens)]])
            self._lengths = np.diff(bounds).astype(np.int64)
        return self._lengths

    def max_token(self) -> int:
        """The largest token id."""
        return int(np.max(self.tokens))

    def digest(self) -> str:
        """sha256 of the token stream (hex)."""
        return hashlib.sha256(self.tokens.tobytes()).hexdigest()
