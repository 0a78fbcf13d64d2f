"""The step log of a training run: one JSON object per optimizer step in ``log.jsonl``."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

__all__ = ["StepLog"]


def _line_step(line: str) -> float:
    """The step of a log line; infinity for a line that is not a complete record (a crash mid-write)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


class StepLog:
    """Append-only JSON Lines log of step records, flushed after each record.

    Args:
        path: the ``log.jsonl`` file.
        start_step: the step the run continues from (0: a new run). A new run starts the file empty; a resumed
            one keeps the records of steps ``<= start_step`` and drops the later ones (they are trained again),
            rewriting the file atomically.
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
