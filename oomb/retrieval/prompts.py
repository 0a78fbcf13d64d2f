"""Retrieval prompts of an exact token length: a passkey in filler text, or "The secret X is Y." needles in real text.

A prompt is one token sequence of exactly ``length`` tokens: ``[BOS] intro haystack question answer``. The answer
(a 5-digit number, with the space token before it where the tokenizer makes one) ends the sequence, so the
model is scored on it teacher-forced (:mod:`oomb.retrieval.score`), without generating.

- **passkey** (Mohtashami & Jaggi, "Landmark Attention", 2023): the intro asks to remember the important
  information, the haystack repeats "The grass is green. The sky is blue. ..." and holds "The pass key is V.
  Remember it. V is the pass key." once; the question is "What is the pass key? The pass key is".
- **needle** (needle in a haystack): the haystack is consecutive tokens of a text token stream (the bundled
  novels by default), from a seeded offset (the stream repeated where the prompt is longer than it), with ``needles`` sentences "The secret W is V." (distinct words W and
  values V) inserted at sentence ends; the question asks for the first needle's value: "What is the secret W?
  The secret W is". The other needles sit at seeded sentence ends as distractors.

Depth ``d`` (percent of the haystack) places the asked needle's first token: 0 is the haystack's first token,
100 puts the needle's last token right before the question, and a depth in between is moved to the nearest
sentence start of the filler or text (at most one sentence away). Positions and values come from a generator
seeded by ``(seed, task, length, depth, trial)``, so the same settings give the same prompts, whatever grid they
are part of.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..data.stats import counted

__all__ = ["TASKS", "RetrievalPrompt", "build_prompts", "check_digits", "needle_prompt", "passkey_prompt"]

TASKS = ("passkey", "needle")
"""The retrieval tasks, in the order their seeds number them."""

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
WORDS = ("apple", "river", "lantern", "meadow", "violin", "harbour", "compass", "pebble", "falcon", "orchard",
         "candle", "saddle", "thimble", "glacier", "quarry", "ribbon", "walnut", "anchor", "beacon", "chimney",
         "dagger", "ember", "feather", "garnet", "hammock", "island", "jasmine", "kettle", "ladder", "marble")
"""The keys of needle sentences ("The secret <word> is <number>.")."""
_ENDS = (".", "!", "?")


@dataclass(frozen=True)
class RetrievalPrompt:
    """One scored sequence.

    Attributes:
        task: ``"passkey"`` or ``"needle"``.
        length: tokens of the sequence (== ``input_ids.numel()``).
        depth: the requested depth (percent of the haystack).
        trial: the trial index within its (length, depth) cell.
        input_ids: int64 ``[length]``: ``[BOS] intro haystack question answer``.
        answer: the value asked for (digits).
        answer_start: index of the answer's first token; the answer runs to the end of the sequence.
        needle_start: index of the asked needle's first token.
        needle_length: tokens of the asked needle sentence.
        haystack: ``(start, end)`` token range of the haystack (needles included).
    """

    task: str
    length: int
    depth: float
    trial: int
    input_ids: torch.Tensor
    answer: str
    answer_start: int
    needle_start: int
    needle_length: int
    haystack: tuple[int, int]

    @property
    def labels(self) -> torch.Tensor:
        """int64 ``[length]``: the answer tokens, -100 elsewhere (what is scored)."""
        labels = torch.full_like(self.input_ids, -100)
        labels[self.answer_start:] = self.input_ids[self.answer_start:]
        return labels

    @property
    def depth_reached(self) -> float:
        """Where the asked needle's first token landed, in percent of the places it could start."""
        start, end = self.haystack
        room = end - start - self.needle_length
        return 100.0 * (self.needle_start - start) / room if room > 0 else 0.0


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _bos(tokenizer) -> list[int]:
    """``[bos_token_id]`` where the tokenizer adds a BOS token to what it encodes, else ``[]``."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    ids = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    return [bos] if ids and ids[0] == bos else []


def check_digits(tokenizer) -> None:
    """Raise ValueError unless ``tokenizer`` encodes the digits 0-9 and decodes them back (the answers are numbers)."""
    digits = "0123456789"
    ids = _encode(tokenizer, digits)
    unk = tokenizer.unk_token_id
    if not ids or (unk is not None and unk in ids) or digits not in tokenizer.decode(ids).replace(" ", ""):
        raise ValueError("the tokenizer cannot encode the digits 0-9 (they come back as unknown tokens), and the "
                         "retrieval answers are numbers; use a tokenizer whose vocabulary has digits")


def _question(tokenizer, question: str, value: str) -> tuple[list[int], list[int]]:
    """(question ids, answer ids): ``question + " " + value`` encoded once, split where ``question`` alone ends."""
    full = _encode(tokenizer, f"{question} {value}")
    alone = _encode(tokenizer, question)
    k = 0
    while k < min(len(full), len(alone)) and full[k] == alone[k]:
        k += 1
    answer = full[k:]
    if not answer or value not in tokenizer.decode(answer).replace(" ", ""):
        check_digits(tokenizer)
        raise ValueError(f"the tokenizer does not encode the answer {value!r} as tokens of its own after "
                         f"{question!r}; use another tokenizer")
    return full[:k], answer


def _rng(seed: int, task: str, length: int, depth: float, trial: int) -> np.random.Generator:
    return np.random.default_rng([seed, TASKS.index(task), length, int(round(depth * 1000)), trial])


def _value(rng: np.random.Generator, taken: Sequence[str] = ()) -> str:
    while True:
        value = str(int(rng.integers(10_000, 100_000)))
        if value not in taken:
            return value


def _place(target: float, starts: Sequence[int], room: int) -> int:
    """The sentence start nearest ``target`` in ``[0, room]`` (``starts`` sorted); 0 and ``room`` exactly at the ends."""
    if target <= 0:
        return 0
    if target >= room:
        return room
    ok = [s for s in starts if 0 <= s <= room]
    return min(ok, key=lambda s: (abs(s - target), s)) if ok else int(round(target))


class PromptTooShort(ValueError):
    """A prompt length too short for its fixed parts: ``fixed`` tokens (BOS, intro, needles, question, answer)
    take the ``length`` asked for, which leaves no haystack token; ``what`` names the fixed parts before
    "question and answer"."""

    def __init__(self, length: int, fixed: int, what: str) -> None:
        super().__init__(f"length {length:,} is too short for a {what}, question and answer take "
                         f"{fixed:,} tokens before any haystack; pass lengths of {fixed + 1} or more")
        self.length, self.fixed, self.what = length, fixed, what


def _filler(tokenizer, room: int) -> tuple[list[int], list[int]]:
    """(token ids, sentence start indices) of the FILLER sentences repeated, whole rounds of them until at least
    ``room`` tokens (the caller cuts the ids at ``room``)."""
    sentences = [_encode(tokenizer, " " + s) for s in FILLER]
    filler, starts = [], []
    while len(filler) < room:
        for s in sentences:
            starts.append(len(filler))
            filler += s
    return filler, starts


def passkey_prompt(tokenizer, length: int, depth: float, trial: int = 0, seed: int = 0) -> RetrievalPrompt:
    """The passkey prompt of ``length`` tokens with the pass key at ``depth`` percent (see the module).

    Raises:
        ValueError: a depth outside [0, 100], a length too short for the intro, pass key sentence, question and
            answer plus one filler token, or a tokenizer that cannot encode digits.
    """
    _check_depth(depth)
    check_digits(tokenizer)
    rng = _rng(seed, "passkey", length, depth, trial)
    value = _value(rng)
    head = _bos(tokenizer) + _encode(tokenizer, INTRO)
    needle = _encode(tokenizer, f" The pass key is {value}. Remember it. {value} is the pass key.")
    question, answer = _question(tokenizer, " What is the pass key? The pass key is", value)
    fixed = len(head) + len(needle) + len(question) + len(answer)
    room = length - fixed  # filler tokens
    if room < 1:
        raise PromptTooShort(length, fixed, "passkey prompt: its intro, pass key sentence")
    filler, starts = _filler(tokenizer, room)
    at = _place(depth / 100 * room, starts, room)
    ids = head + filler[:at] + needle + filler[at:room] + question + answer
    return RetrievalPrompt("passkey", length, float(depth), trial, torch.tensor(ids, dtype=torch.int64), value,
                           length - len(answer), len(head) + at, len(needle), (len(head), length - len(question) - len(answer)))


def _sentence_starts(tokenizer, ids: np.ndarray) -> list[int]:
    """Indices ``i`` in ``[1, len(ids))`` whose token ``i - 1`` ends a sentence (., ! or ?, closing quotes aside)."""
    ends = {}
    for t in np.unique(ids).tolist():
        text = tokenizer.decode([t]).rstrip().rstrip("\"'\u201d\u2019)")
        ends[t] = text.endswith(_ENDS)
    return [i + 1 for i, t in enumerate(ids[:-1].tolist()) if ends[t]]


def needle_prompt(tokenizer, tokens: np.ndarray, length: int, depth: float, trial: int = 0, seed: int = 0,
                  needles: int = 1) -> RetrievalPrompt:
    """The needle prompt of ``length`` tokens: ``needles`` "The secret W is V." sentences in a haystack cut from
    ``tokens``, the first one (the one asked) at ``depth`` percent (see the module).

    Args:
        tokens: int ``[N]`` token stream of real text in ``tokenizer``'s ids (:func:`oomb.data.tokenize_documents`);
            the haystack is ``room`` consecutive tokens of it from a seeded offset (the stream repeated, from that
            offset, where it is shorter than that).

    Raises:
        ValueError: a depth outside [0, 100], ``needles`` outside [1, 30], a length too short for the needles,
            question and answer plus one text token, an empty ``tokens``, or a tokenizer that cannot encode digits.
    """
    _check_depth(depth)
    if not 1 <= needles <= len(WORDS):
        raise ValueError(f"needles is {needles}; pass 1 to {len(WORDS)} needles per prompt")
    check_digits(tokenizer)
    rng = _rng(seed, "needle", length, depth, trial)
    words = [WORDS[i] for i in rng.choice(len(WORDS), size=needles, replace=False)]
    values: list[str] = []
    for _ in words:
        values.append(_value(rng, values))
    head = _bos(tokenizer)
    sentences = [_encode(tokenizer, f" The secret {w} is {v}.") for w, v in zip(words, values)]
    question, answer = _question(tokenizer, f" What is the secret {words[0]}? The secret {words[0]} is", values[0])
    fixed = len(head) + sum(map(len, sentences)) + len(question) + len(answer)
    room = length - fixed  # text tokens
    if room < 1:
        raise PromptTooShort(length, fixed, f"needle prompt: its {counted(needles, 'needle sentence')}")
    n = int(tokens.shape[0])
    if n < 1:
        raise ValueError("the text has no tokens; give some text to hide the needles in")
    if n >= room:
        offset = int(rng.integers(0, n - room + 1))
        text = np.asarray(tokens[offset : offset + room], dtype=np.int64)
    else:  # the whole stream, repeated from a seeded offset
        offset = int(rng.integers(0, n))
        text = np.resize(np.roll(np.asarray(tokens, dtype=np.int64), -offset), room)
    starts = _sentence_starts(tokenizer, text)
    at = _place(depth / 100 * room, starts, room)
    inner = [s for s in starts if 0 < s < room and s != at] or [s for s in range(1, room) if s != at] or [at]
    others = [int(inner[i]) for i in rng.integers(0, len(inner), size=needles - 1)]
    inserts = sorted([(at, 0)] + [(p, k + 1) for k, p in enumerate(others)])
    ids, prev, needle_start = list(head), 0, -1
    for p, k in inserts:
        ids += text[prev:p].tolist()
        if k == 0:
            needle_start = len(ids)
        ids += sentences[k]
        prev = p
    ids += text[prev:].tolist()
    hay_end = len(ids)
    ids += question + answer
    return RetrievalPrompt("needle", length, float(depth), trial, torch.tensor(ids, dtype=torch.int64), values[0],
                           length - len(answer), needle_start, len(sentences[0]), (len(head), hay_end))


def _check_depth(depth: float) -> None:
    if not 0 <= depth <= 100:
        raise ValueError(f"depth {depth} is outside [0, 100]; pass depths in percent of the haystack, from 0 to 100")


def build_prompts(task: str, tokenizer, lengths: Sequence[int], depths: Sequence[float], trials: int = 1,
                  seed: int = 0, tokens: np.ndarray | None = None, needles: int = 1) -> list[RetrievalPrompt]:
    """Every prompt of the grid: for each length, each depth, ``trials`` trials (``trial`` 0 .. trials - 1).

    Args:
        task: ``"passkey"`` or ``"needle"``.
        tokens: the needle task's text token stream (required there, unused for passkey).
        needles: needle sentences per needle prompt.

    Raises:
        ValueError: an unknown task, no tokens for the needle task, and what :func:`passkey_prompt` and
            :func:`needle_prompt` raise.
    """
    if task not in TASKS:
        raise ValueError(f"task is {task!r}; pass one of {', '.join(TASKS)}")
    if task == "needle" and tokens is None:
        raise ValueError("the needle task needs a text token stream (tokens) to hide the needles in")
    out = []
    for length in lengths:
        for depth in depths:
            for trial in range(trials):
                if task == "passkey":
                    out.append(passkey_prompt(tokenizer, length, depth, trial, seed))
                else:
                    out.append(needle_prompt(tokenizer, tokens, length, depth, trial, seed, needles))
    return out
