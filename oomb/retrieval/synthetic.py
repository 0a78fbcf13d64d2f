"""Synthetic retrieval training rows: passkey and needle prompts with their answers, as prompt/completion rows,
and key-value rows that ask for many values of one long context, as segments rows.

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

A **keyvalue** row trains many answers at long range from one context: the passkey prompt's intro and filler
holding its pass key sentence and ``needles`` "The secret W is V." sentences (distinct words and values) at
random sentence starts, then a question for every one of them in a random order, each followed by its answer:
" What is the pass key? The pass key is V" and " What is the secret W? The secret W is V". It is written as a
``segments`` row (:mod:`oomb.data.chat`): the answers (" V") are the segments labelled true, so every answer and
the final EOS are trained, nothing else. A passkey row trains one answer per ``L`` tokens; a keyvalue row
``needles + 1``, at distances spread over the whole row. With several numbers in the context the key must be
matched to pick the answer, which a small model may not learn at all (``docs/performance.md``, "Row lengths, and
many answers per row"); ``needles=0`` gives the passkey row's tokens as a segments row, so the two mix in one
``--data`` folder. Its pass key is asked with the exact words of the passkey evaluation. A row is exactly ``L``
tokens as training encodes it (segments, then EOS), checked by encoding it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..data.stats import counted
from .prompts import INTRO, WORDS, PromptTooShort, _bos, _encode, _filler, _place, _question, _value, check_digits, \
    needle_prompt, passkey_prompt

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
    """``examples`` rows of ``task`` ("passkey", "needle" or "keyvalue"), seeded by ``seed`` (see the module).

    Args:
        lengths: token lengths, as training encodes a row (its EOS included); each row takes one, drawn uniformly.
        tokens: the needle task's text token stream (:func:`oomb.data.tokenize_documents`).
        needles: needle sentences per needle row (the first is asked), or secret sentences per keyvalue row (each
            asked, and the pass key).

    Raises:
        ValueError: ``examples`` < 1, no lengths, an unknown task, no tokens for the needle task, and what the
            prompt builders raise (a length too short for the prompt and its EOS, a tokenizer without digits), and
            a row that re-encodes to no prompt length's worth of tokens (see :func:`_row`).
    """
    if examples < 1:
        raise ValueError(f"examples is {examples}; pass 1 or more")
    if not lengths:
        raise ValueError("lengths is empty; pass one or more token lengths")
    if task not in ("passkey", "needle", "keyvalue"):
        raise ValueError(f"task is {task!r}; pass passkey, needle or keyvalue")
    if task == "keyvalue" and not 0 <= needles <= len(WORDS):
        raise ValueError(f"needles is {needles}; pass 0 to {len(WORDS)} secret sentences per keyvalue row")
    if task == "needle" and tokens is None:
        raise ValueError("the needle task needs a text token stream (tokens) to hide the needles in")
    rng = np.random.default_rng([seed, 7])
    rows = []
    for i in range(examples):
        length = int(lengths[int(rng.integers(len(lengths)))])
        depth = round(float(rng.uniform(0.0, 100.0)), 3)
        if task == "keyvalue":
            rows.append(_keyvalue_row(tokenizer, length, depth, _TRIAL_BASE + i, seed, needles))
        else:
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
            raise ValueError(f"length {length:,} is too short for a {exc.what}, question, answer and EOS take {need:,} "
                             f"tokens before any haystack; pass lengths of {need + 1} or more") from exc
        ids = prompt.input_ids.tolist()
        # Special tokens inside (the EOS between the text's documents) stay as their text, which encodes back to them.
        question = tokenizer.decode(ids[bos:prompt.answer_start])
        answer = tokenizer.decode(ids[prompt.answer_start:])
        got = len(encode_prompt_completion(tokenizer, question, answer, None, "assistant", "")[0])
        if got == length:
            return {"prompt": question, "completion": answer, "task": task, "length": length, "depth": depth,
                    "answer": prompt.answer}
    raise ValueError(f"none of {_TRIES} {task} prompts of {length:,} tokens re-encodes to {length:,} tokens with this "
                     "tokenizer (their decoded text tokenises differently); pass other lengths, or another tokenizer")


def _keyvalue_draw(tokenizer, length: int, depth: float, rng: np.random.Generator, needles: int):
    """One keyvalue row's (segments as token-id lists with their labels, pass key value, all values) of ``length``
    tokens, the EOS included (see the module).

    Raises:
        PromptTooShort: ``length`` leaves no filler token.
    """
    words = [WORDS[i] for i in rng.choice(len(WORDS), size=needles, replace=False)]
    values: list[str] = []
    for _ in range(needles + 1):
        values.append(_value(rng, values))
    passkey = values[0]
    sentences = [_encode(tokenizer, f" The pass key is {passkey}. Remember it. {passkey} is the pass key.")]
    sentences += [_encode(tokenizer, f" The secret {w} is {v}.") for w, v in zip(words, values[1:])]
    asks = [" What is the pass key? The pass key is"] + [f" What is the secret {w}? The secret {w} is" for w in words]
    qa = [_question(tokenizer, q, v) for q, v in zip(asks, values)]
    order = rng.permutation(len(qa)).tolist()
    head = _encode(tokenizer, INTRO)
    fixed = len(head) + sum(map(len, sentences)) + sum(len(q) + len(a) for q, a in qa) + 1  # + EOS
    room = length - fixed
    if room < 1:
        raise PromptTooShort(length, fixed - 1, f"keyvalue row: its intro, pass key and {counted(needles, 'secret sentence')}")
    filler, starts = _filler(tokenizer, room)
    filler = filler[:room]
    inner = [p for p in starts if p <= room] or [0]
    # The pass key at ``depth`` (as the passkey prompt places it), the secrets at random sentence starts.
    spots = [(_place(depth / 100 * room, starts, room), 0)]
    spots += [(int(inner[int(rng.integers(len(inner)))]), k + 1) for k in range(needles)]
    ids, prev = list(head), 0
    for p, k in sorted(spots):
        ids += filler[prev:p] + sentences[k]
        prev = p
    ids += filler[prev:]
    segments = []
    for k in order:  # the context goes into the first question's segment
        q, a = qa[k]
        segments += [(q if segments else ids + q, False), (a, True)]
    return segments, passkey, values


def _keyvalue_row(tokenizer, length: int, depth: float, trial: int, seed: int, needles: int) -> dict:
    """The keyvalue row of ``length`` tokens as training encodes it (see the module).

    Raises:
        ValueError: ``length`` too short, or none of :data:`_TRIES` rows drawn re-encodes to ``length`` tokens.
    """
    from ..data.chat import encode_segments

    check_digits(tokenizer)
    for k in range(_TRIES):
        rng = np.random.default_rng([seed, 2, length, int(round(depth * 1000)), trial + k * _RETRY_STRIDE])
        try:
            parts, passkey, values = _keyvalue_draw(tokenizer, length, depth, rng, needles)
        except PromptTooShort as exc:
            raise ValueError(f"length {length:,} is too short for a {exc.what}, their questions and answers and the EOS "
                             f"take {exc.fixed + 1:,} tokens before any filler; pass lengths of {exc.fixed + 2} or more, "
                             "or fewer needles") from exc
        segments = [{"text": tokenizer.decode(ids), "label": label} for ids, label in parts]
        want = [t for ids, _ in parts for t in ids]
        got, _ = encode_segments(tokenizer, segments, "assistant", "keyvalue row")
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        if got.tolist() == want + eos and len(got) == length:
            return {"segments": segments, "task": "keyvalue", "length": length, "depth": depth, "answer": passkey,
                    "answers": values}
    raise ValueError(f"none of {_TRIES} keyvalue rows of {length:,} tokens re-encodes to the same tokens with this "
                     "tokenizer (their decoded text tokenises differently); pass other lengths, or another tokenizer")


def is_retrieval_jsonl(path: str | os.PathLike) -> bool:
    """Whether ``path`` is blank or every non-blank line of it is a row of :func:`retrieval_rows` (a file this
    module wrote, which may be replaced: a file that also holds other rows is not)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    return False
                if not isinstance(row, dict) or not set(_OWN_KEYS) <= row.keys():
                    return False
    except (OSError, UnicodeDecodeError):
        return False
    return True


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
