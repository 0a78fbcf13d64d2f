"""Synthetic retrieval training rows: passkey and needle prompts with their answers, as prompt/completion rows.

Each row is one prompt of :mod:`oomb.retrieval.prompts` (haystack and question) decoded to text as ``prompt``,
and its answer decoded as ``completion``, at a length drawn from the given lengths and a depth drawn uniformly
from [0, 100]. ``oomb train --data rows.jsonl`` reads them as prompt/completion rows: the answer and the EOS
token after it are trained, the prompt is not (``--loss-on all`` trains every token). Training the answer only
is what makes a model learn retrieval from random weights: with every token trained, the loss is dominated by
the predictable filler and the answer's log-probability stays at chance (``benchmarks/passkey_loss_recipe_cpu.py``
measures both). The rows also carry ``task``, ``length``, ``depth`` and ``answer``.

A row of length ``L`` is ``L`` tokens of the tokenizer the rows are made with as ``oomb train`` encodes it
(:func:`oomb.data.chat.encode_prompt_completion`: prompt and completion with no special token added, then the
EOS token), so it fits ``--seq-len L``. Its prompt and completion are a scored prompt of ``L - 1`` tokens
(``L`` where the tokenizer adds a BOS token, which the row leaves out) decoded with its special tokens as text
(the EOS between the needle text's documents is ``</s>`` or the like), and re-encode to its tokens, so what is
trained is what ``oomb eval --task`` scores. A needle haystack that begins inside a word of the text can
re-encode to another token count; such a row takes the next prompt drawn (another haystack) that re-encodes to
``L`` tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .prompts import PromptTooShort, _bos, needle_prompt, passkey_prompt

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
        lengths: token lengths, as training encodes a row (its EOS included); each row takes one, drawn uniformly.
        tokens: the needle task's text token stream (:func:`oomb.data.tokenize_documents`).
        needles: needle sentences per needle row (the first is asked).

    Raises:
        ValueError: ``examples`` < 1, no lengths, an unknown task, no tokens for the needle task, and what the
            prompt builders raise (a length too short for the prompt and its EOS, a tokenizer without digits), and
            a row that re-encodes to no prompt length's worth of tokens (see :func:`_row`).
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
        rows.append(_row(task, tokenizer, length, depth, _TRIAL_BASE + i, seed, tokens, needles))
    return rows


_TRIES = 32
"""Prompts drawn for one row before giving up on one that re-encodes to its length."""

_RETRY_STRIDE = 1 << 40
"""Draw ``k`` of a row of trial ``t`` is the prompt of trial ``t + k * _RETRY_STRIDE``."""


def _row(task: str, tokenizer, length: int, depth: float, trial: int, seed: int, tokens, needles: int) -> dict:
    """The row of ``length`` tokens as training encodes it (see the module).

    Raises:
        ValueError: ``length`` too short for the prompt and the EOS, or none of :data:`_TRIES` prompts drawn
            re-encodes to ``length`` tokens.
    """
    from ..data.chat import encode_prompt_completion

    bos = len(_bos(tokenizer))
    # The tokens a row has beyond its prompt's: the EOS training appends, less the BOS the row leaves out.
    extra = (tokenizer.eos_token_id is not None) - bos
    for k in range(_TRIES):
        try:
            if task == "passkey":
                prompt = passkey_prompt(tokenizer, length - extra, depth, trial + k * _RETRY_STRIDE, seed)
            else:
                prompt = needle_prompt(tokenizer, tokens, length - extra, depth, trial + k * _RETRY_STRIDE, seed,
                                       needles)
        except PromptTooShort as exc:
            need = exc.fixed + extra
            raise ValueError(f"length {length} is too short for a {exc.what}, question, answer and EOS take {need} "
                             f"tokens before any haystack; pass lengths of {need + 1} or more") from exc
        ids = prompt.input_ids.tolist()
        # Special tokens inside (the EOS between the text's documents) stay as their text, which encodes back to them.
        question = tokenizer.decode(ids[bos:prompt.answer_start])
        answer = tokenizer.decode(ids[prompt.answer_start:])
        got = len(encode_prompt_completion(tokenizer, question, answer, None, "assistant", "")[0])
        if got == length:
            return {"prompt": question, "completion": answer, "task": task, "length": length, "depth": depth,
                    "answer": prompt.answer}
    raise ValueError(f"none of {_TRIES} {task} prompts of {length} tokens re-encodes to {length} tokens with this "
                     "tokenizer (their decoded text tokenises differently); pass other lengths, or another tokenizer")


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
