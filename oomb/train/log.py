"""The step logs of a training run: one JSON object per optimizer step in ``log.jsonl`` (:class:`StepLog`), and the
same records as TensorBoard scalars (:class:`TensorBoardLog`). Both take :meth:`StepRecord.to_json` dicts, and the
held-out evaluations' :meth:`ValRecord.to_json` dicts (``step``, ``val_loss``, ``val_tokens``, ...; no ``loss``): a
line of their own after their step's line."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

__all__ = ["StepLog", "TensorBoardLog", "TENSORBOARD_SCALARS"]


def _line_step(line: str) -> float:
    """The step of a log line; infinity for a line that is not a complete record (a crash mid-write)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


class StepLog:
    """Append-only JSON Lines log of step records (and held-out records), flushed after each record.

    Args:
        path: the ``log.jsonl`` file.
        start_step: the step the run continues from (0: a new run). A new run starts the file empty; a resumed
            one keeps the records of steps ``<= start_step`` (the held-out records of those steps too) and drops the
            later ones (they are trained and evaluated again), rewriting the file atomically.
    """

    def __init__(self, path: str | os.PathLike, start_step: int = 0) -> None:
        self.path = Path(path)
        if start_step and self.path.is_file():
            kept = [ln for ln in self.path.read_text(errors="replace").splitlines() if _line_step(ln) <= start_step]
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text("".join(ln + "\n" for ln in kept))
            os.replace(tmp, self.path)
        elif not start_step and self.path.is_file():
            self.path.unlink()
        self._file = None

    def open(self) -> "StepLog":
        self._file = open(self.path, "a", encoding="utf-8")
        return self

    def write(self, record: dict) -> None:
        """Append ``record`` (JSON-serialisable) as one line."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "StepLog":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


TENSORBOARD_SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
                       "tokens_per_s": "perf/tokens_per_s", "peak_memory_gib": "perf/peak_memory_gib",
                       "val_loss": "val/loss"}
"""Record key -> TensorBoard tag of each scalar :class:`TensorBoardLog` writes (``peak_memory_gib``: the record's
``peak_memory_bytes`` / 2**30, where the record has one)."""


class TensorBoardLog:
    """TensorBoard event files of step records (``torch.utils.tensorboard.SummaryWriter``), with the
    :class:`StepLog` interface: ``open``, ``write(record)``, ``close``.

    Args:
        logdir: the folder of the event files.
        start_step: the step the run continues from (0: a new run). A resumed run purges the events of the steps
            after ``start_step`` (they are trained again: TensorBoard's ``purge_step``), as :class:`StepLog` drops
            their lines.
    """

    def __init__(self, logdir: str | os.PathLike, start_step: int = 0) -> None:
        self.logdir = Path(logdir)
        self.start_step = start_step
        self._writer = None

    def open(self) -> "TensorBoardLog":
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(self.logdir), purge_step=self.start_step + 1 if self.start_step else None)
        return self

    def write(self, record: dict) -> None:
        """Add ``record``'s scalars at its ``step``; flushed at once (a killed run keeps what it logged)."""
        values = dict(record)
        if values.get("peak_memory_bytes") is not None:
            values["peak_memory_gib"] = values["peak_memory_bytes"] / 2**30
        for key, tag in TENSORBOARD_SCALARS.items():
            if values.get(key) is not None:
                self._writer.add_scalar(tag, float(values[key]), int(record["step"]))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "TensorBoardLog":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
