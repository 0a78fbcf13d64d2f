"""Synthetic retrieval training text: passkey and needle prompts with their answers, as ``{"text": ...}`` rows.

Each row is one prompt of :mod:`oomb.retrieval.prompts` (haystack, question and answer) decoded to text, at a
length drawn from the given lengths and a depth drawn uniformly from [0, 100], so that a model trained on the
rows (``oomb train --data rows.jsonl``: text rows, every token trained) learns to retrieve at every depth. The
rows also carry ``task``, ``length``, ``depth`` and ``answer`` (the text reader reads only ``text``). Lengths
are in tokens of the tokenizer the rows are made with; the decoded text re-encodes to about that many.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .prompts import needle_prompt, passkey_prompt

__all__ = ["ROW_KEYS", "is_retrieval_jsonl", "retrieval_rows", "write_retrieval_jsonl"]

ROW_KEYS = ("text", "task", "length", "depth", "answer")
"""The keys of every row (what tells a file of these rows from any other)."""

_TRIAL_BASE = 1 << 20
"""Trial numbers of the training rows start here, away from the few trials an evaluation grid uses."""


def retrieval_rows(task: str, tokenizer, lengths: Sequence[int], examples: int, seed: int = 0,
                   tokens: np.ndarray | None = None, needles: int = 1) -> list[dict]:
    """``examples`` rows of ``task`` ("passkey" or "needle"), seeded by ``seed`` (see the module).

    Args:
        lengths: token lengths; each row takes one, drawn uniformly.
        tokens: the needle task's text token stream (:func:`oomb.data.tokenize_documents`).
        needles: needle sentences per needle row (the first is asked).

    Raises:
        ValueError: ``examples`` < 1, no lengths, an unknown task, no tokens for the needle task, and what the
            prompt builders raise (a length too short, a tokenizer without digits).
    """
    if examples < 1:
        raise ValueError(f"examples is {examples}; pass 1 or more")
    if not lengths:
        raise ValueError("lengths is empty; pass one or more token lengths")
    if task not in ("passkey", "needle"):
        raise ValueError(f"task is {task!r}; pass passkey or needle")
    if task == "needle" and tokens is None:
        raise ValueError("the needle task needs a text token stream (tokens) to hide the needles in")
    rng = np.random.default_rng([seed, 7])
    rows = []
    for i in range(examples):
        length = int(lengths[int(rng.integers(len(lengths)))])
        depth = round(float(rng.uniform(0.0, 100.0)), 3)
        if task == "passkey":
            prompt = passkey_prompt(tokenizer, length, depth, _TRIAL_BASE + i, seed)
        else:
            prompt = needle_prompt(tokenizer, tokens, length, depth, _TRIAL_BASE + i, seed, needles)
        text = tokenizer.decode(prompt.input_ids.tolist(), skip_special_tokens=True)
        rows.append({"text": text, "task": task, "length": length, "depth": depth, "answer": prompt.answer})
    return rows


def is_retrieval_jsonl(path: str | os.PathLike) -> bool:
    """Whether ``path`` is empty or its first line is a row of :func:`retrieval_rows` (a file this module wrote)."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
    except (OSError, UnicodeDecodeError):
        return False
    if not first.strip():
        return Path(path).stat().st_size == 0 or not Path(path).read_text(encoding="utf-8").strip()
    try:
        row = json.loads(first)
    except ValueError:
        return False
    return isinstance(row, dict) and set(ROW_KEYS) <= row.keys()


def write_retrieval_jsonl(path: str | os.PathLike, rows: Sequence[dict]) -> Path:
    """Write ``rows`` as JSON Lines to ``path`` atomically (a temporary file beside it, then renamed). Returns the path."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
