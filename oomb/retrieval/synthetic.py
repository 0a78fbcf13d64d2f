"""Synthetic retrieval training rows: passkey and needle prompts with their answers, as prompt/completion rows.

Each row is one prompt of :mod:`oomb.retrieval.prompts` (haystack and question) decoded to text as ``prompt``,
and its answer decoded as ``completion``, at a length drawn from the given lengths and a depth drawn uniformly
from [0, 100]. ``oomb train --data rows.jsonl`` reads them as prompt/completion rows: the answer and the EOS
token after it are trained, the prompt is not (``--loss-on all`` trains every token). Training the answer only
is what makes a model learn retrieval from random weights: with every token trained, the loss is dominated by
the predictable filler and the answer's log-probability stays at chance (``benchmarks/passkey_loss_recipe_cpu.py``
measures both). The rows also carry ``task``, ``length``, ``depth`` and ``answer``. Lengths are in tokens of
the tokenizer the rows are made with. The prompt and the completion, each encoded without special tokens,
re-encode to the scored prompt's tokens (BOS dropped where it had one; a needle haystack that begins inside a
word of the text may re-encode differently there), so what is trained is what ``oomb eval --task`` scores.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .prompts import needle_prompt, passkey_prompt

__all__ = ["ROW_KEYS", "is_retrieval_jsonl", "retrieval_rows", "write_retrieval_jsonl"]

ROW_KEYS = ("prompt", "completion", "task", "length", "depth", "answer")
"""The keys of every row."""

_OWN_KEYS = ("task", "length", "depth", "answer")
"""The keys that tell a file of these rows from any other (also one written with a ``text`` key instead of
prompt and completion)."""

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
        ids = prompt.input_ids.tolist()
        question = tokenizer.decode(ids[:prompt.answer_start], skip_special_tokens=True)
        answer = tokenizer.decode(ids[prompt.answer_start:], skip_special_tokens=True)
        rows.append({"prompt": question, "completion": answer, "task": task, "length": length, "depth": depth,
                     "answer": prompt.answer})
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
    return isinstance(row, dict) and set(_OWN_KEYS) <= row.keys()


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
