"""Examples packed into ``seq_len``-token sequences, each example its own document.

Examples are placed in order: one that does not fit in what is left of the current sequence starts the next
one. Each example is a document of the sequence's ``cu_seqlens``, so attention and positions restart at it and
no loss crosses its bounds; the end of a sequence is filled with padding tokens (label -100), a document of
their own. An example longer than ``seq_len`` is dropped (``long_examples="drop"``) or cut into ``seq_len``
pieces (``"split"``): the whole pieces are sequences of their own, the last piece goes on like an example.
An example or piece without a trained token is left out (it would give a sequence nothing to learn).

The sequences are kept in shards of :data:`SHARD_SEQUENCES` (in memory, or ``.npy`` files in a folder that
:meth:`PackedSequences.load` maps back without reading them).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from .chat import IGNORE_INDEX
from .sequences import Sample, seeded_order
from .stats import DataStats

__all__ = ["SHARD_SEQUENCES", "PackedSequences", "Packer", "pack"]

SHARD_SEQUENCES = 1024
"""Sequences per shard."""

_ARRAYS = ("tokens", "mask", "bounds", "offsets")


class _Shard:
    """``tokens`` int32 [k, S], ``mask`` uint8 [k, S] (1: the label is the token, 0: -100), ``bounds`` int32
    (every sequence's cu_seqlens, one after the other), ``offsets`` int64 [k + 1] (where each one's starts)."""

    def __init__(self, tokens, mask, bounds, offsets) -> None:
        self.tokens, self.mask, self.bounds, self.offsets = tokens, mask, bounds, offsets

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class Packer:
    """Packs examples (``add``) into sequences; ``finish`` returns them.

    Args:
        seq_len: tokens per sequence (>= 2).
        long_examples: "split" or "drop" (see the module).
        pad_id: the token id of padding.
        fmt: the data format, for the statistics.
        shard_dir: write each full shard there as .npy files (None: keep them in memory).
    """

    def __init__(self, seq_len: int, long_examples: str, pad_id: int, fmt: str, shard_dir: Path | None = None) -> None:
        self.S = seq_len
        self.long = long_examples
        self.pad_id = pad_id
        self.fmt = fmt
        self.shard_dir = shard_dir
        self.shards: list[_Shard] = []
        self._ids: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._bounds: list[int] = [0]
        self._used = 0
        self._seqs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.lengths: list[int] = []
        self.n = dict(examples=0, tokens=0, trained=0, padding=0, split=0, dropped=0, dropped_tokens=0, sequences=0,
                      split_unused=0, untrained=0)

    # ---- input

    def add(self, ids: np.ndarray, labels: np.ndarray) -> None:
        """One example: ids and labels int64 ``[n]`` (labels -100 or the id)."""
        n = int(ids.shape[0])
        self.lengths.append(n)
        self.n["examples"] += 1
        self.n["tokens"] += n
        mask = labels != IGNORE_INDEX
        if n < 2 or not mask[1:].any():
            self.n["untrained"] += 1
            self._drop(n)
            return
        if n > self.S:
            if self.long == "drop":
                self._drop(n)
                return
            self.n["split"] += 1
            self._flush()
            whole = n // self.S * self.S
            for a in range(0, whole, self.S):
                if mask[a + 1: a + self.S].any():
                    self._emit(ids[a: a + self.S], mask[a: a + self.S], [0, self.S])
                else:
                    self.n["split_unused"] += self.S
            ids, mask = ids[whole:], mask[whole:]
            if ids.shape[0] < 2 or not mask[1:].any():
                self.n["split_unused"] += int(ids.shape[0])
                return
        if self._used + ids.shape[0] > self.S:
            self._flush()
        self._ids.append(ids)
        self._mask.append(mask)
        self._used += int(ids.shape[0])
        self._bounds.append(self._used)

    def _drop(self, n: int) -> None:
        self.n["dropped"] += 1
        self.n["dropped_tokens"] += n

    def _flush(self) -> None:
        if not self._used:
            return
        pad = self.S - self._used
        ids = np.concatenate(self._ids + [np.full(pad, self.pad_id, dtype=np.int64)])
        mask = np.concatenate(self._mask + [np.zeros(pad, dtype=bool)])
        bounds = self._bounds + ([self.S] if pad else [])
        self.n["padding"] += pad
        self._emit(ids, mask, bounds)
        self._ids, self._mask, self._bounds, self._used = [], [], [0], 0

    def _emit(self, ids: np.ndarray, mask: np.ndarray, bounds: list[int]) -> None:
        starts = np.zeros(self.S, dtype=bool)
        starts[bounds[:-1]] = True
        self.n["trained"] += int((mask & ~starts).sum())
        self.n["sequences"] += 1
        self._seqs.append((ids.astype(np.int32), mask.astype(np.uint8), np.asarray(bounds, dtype=np.int32)))
        if len(self._seqs) == SHARD_SEQUENCES:
            self._close_shard()

    def _close_shard(self) -> None:
        if not self._seqs:
            return
        tokens = np.stack([s[0] for s in self._seqs])
        mask = np.stack([s[1] for s in self._seqs])
        bounds = np.concatenate([s[2] for s in self._seqs])
        offsets = np.concatenate([[0], np.cumsum([len(s[2]) for s in self._seqs])]).astype(np.int64)
        self._seqs = []
        shard = _Shard(tokens, mask, bounds, offsets)
        if self.shard_dir is not None:
            k = len(self.shards)
            for name in _ARRAYS:
                np.save(self.shard_dir / f"{name}-{k:05d}.npy", getattr(shard, name))
            shard = _Shard(*(np.load(self.shard_dir / f"{name}-{k:05d}.npy", mmap_mode="r") for name in _ARRAYS))
        self.shards.append(shard)

    # ---- output

    def dropped_reasons(self) -> tuple[int, int]:
        """``(too_long, untrained)``: examples dropped for being longer than ``seq_len`` (``long_examples="drop"``)
        and for holding no trained token after their first (an empty completion, a row of one token)."""
        return self.n["dropped"] - self.n["untrained"], self.n["untrained"]

    def stats(self) -> DataStats:
        n = self.n
        return DataStats(format=self.fmt, examples=n["examples"], tokens=n["tokens"], sequences=n["sequences"],
                         seq_len=self.S, trained_tokens=n["trained"], padding=n["padding"], split_examples=n["split"],
                         dropped_examples=n["dropped"], dropped_tokens=n["dropped_tokens"],
                         split_unused_tokens=n["split_unused"])

    def finish(self, seed: int) -> "PackedSequences":
        """The packed sequences (served in the order of ``seed``); with a ``shard_dir``, also its manifest."""
        self._flush()
        self._close_shard()
        stats = self.stats()
        lengths = np.asarray(self.lengths, dtype=np.int64)
        if self.shard_dir is not None:
            np.save(self.shard_dir / "lengths.npy", lengths)
            manifest = {"shards": len(self.shards), "stats": stats.as_dict()}
            (self.shard_dir / "manifest.json").write_text(json.dumps(manifest))
        return PackedSequences(self.shards, stats, seed, lengths)


class PackedSequences:
    """Packed sequences as :class:`Sample` objects: labels (-100 outside the trained tokens and on padding)
    and cu_seqlens (one document per example and one for the padding)."""

    def __init__(self, shards: list[_Shard], stats: DataStats, seed: int = 0,
                 example_lengths: np.ndarray | None = None) -> None:
        self.shards = shards
        self.example_lengths = np.zeros(0, dtype=np.int64) if example_lengths is None else example_lengths
        """Tokens of every example read (int64 [examples]), the dropped ones included."""
        self.stats = stats
        self.seed = seed
        self._starts = np.concatenate([[0], np.cumsum([len(s) for s in shards])]).astype(np.int64)

    @classmethod
    def load(cls, folder: Path, seed: int = 0) -> "PackedSequences | None":
        """The sequences a :class:`Packer` wrote to ``folder`` (memory-mapped); None if it holds no complete set."""
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
            shards = [_Shard(*(np.load(folder / f"{name}-{k:05d}.npy", mmap_mode="r") for name in _ARRAYS))
                      for k in range(int(manifest["shards"]))]
            fields = {k: v for k, v in manifest["stats"].items() if k != "trained_share"}
            return cls(shards, DataStats(**fields), seed, np.load(folder / "lengths.npy", mmap_mode="r"))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def __len__(self) -> int:
        return int(self._starts[-1])

    def order(self, epoch: int) -> np.ndarray:
        """The seeded permutation of sequence indices for ``epoch`` (0-based)."""
        return seeded_order(len(self), self.seed, epoch)

    def arrays(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sequence ``i``: token ids int64 [S], trained mask bool [S], cu_seqlens int64 [D + 1]."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = int(np.searchsorted(self._starts, i, side="right") - 1)
        shard, j = self.shards[k], i - int(self._starts[k])
        lo, hi = int(shard.offsets[j]), int(shard.offsets[j + 1])
        return (np.asarray(shard.tokens[j], dtype=np.int64), np.asarray(shard.mask[j], dtype=bool),
                np.asarray(shard.bounds[lo:hi], dtype=np.int64))

    def __getitem__(self, i: int) -> Sample:
        ids, mask, cu = self.arrays(i)
        labels = np.where(mask, ids, IGNORE_INDEX)
        return Sample(torch.from_numpy(ids).view(1, -1), torch.from_numpy(labels).view(1, -1), torch.from_numpy(cu))

    def digest(self) -> str:
        """sha256 (hex) of every sequence's tokens, mask and bounds."""
        h = hashlib.sha256()
        for s in self.shards:
            for name in _ARRAYS:
                h.update(np.ascontiguousarray(getattr(s, name)).tobytes())
        return h.hexdigest()

    def max_token(self) -> int:
        """The largest token id (-1 when empty)."""
        return max((int(np.max(s.tokens)) for s in self.shards if len(s)), default=-1)


def pack(examples: Iterable[tuple[np.ndarray, np.ndarray]], seq_len: int, long_examples: str, pad_id: int,
         fmt: str = "messages", seed: int = 0) -> PackedSequences:
    """Pack ``examples`` (ids, labels) in memory (see :class:`Packer`)."""
    packer = Packer(seq_len, long_examples, pad_id, fmt)
    for ids, labels in examples:
        packer.add(ids, labels)
    return packer.finish(seed)
