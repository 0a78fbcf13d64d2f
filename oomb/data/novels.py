"""A long-context chat dataset made from the bundled novels: a passage as context, a question about it and
its answer.

Each example is ``{"messages": [user, assistant]}``: the user turn holds a passage of about
``passage_chars`` characters of one novel (cut at line ends) and asks which sentence follows a given
sentence of that passage; the assistant turn is that next sentence, quoted from the passage. The answer needs
the context (a retrieval question of the kind long-context fine-tuning is for), and only it is trained.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from .build import load_documents

__all__ = ["chat_novel_examples", "write_chat_novels"]

_SENTENCE = re.compile(r"[^.!?]*[.!?]")


def _sentences(text: str) -> list[str]:
    return [" ".join(s.split()) for s in _SENTENCE.findall(text) if 30 <= len(" ".join(s.split())) <= 300]


def chat_novel_examples(examples: int, passage_chars: int = 60_000, seed: int = 0) -> list[dict]:
    """``examples`` rows ``{"messages": [...]}`` drawn with ``seed`` from the bundled novels (see the module).

    Raises:
        ValueError: ``examples`` < 1 or ``passage_chars`` < 2,000 or longer than the shortest novel.
    """
    docs = load_documents(None)
    if examples < 1 or passage_chars < 2000 or passage_chars > min(len(d.text) for d in docs):
        raise ValueError(f"examples {examples} and passage_chars {passage_chars}: need examples >= 1 and "
                         "2,000 <= passage_chars <= the shortest novel's length")
    rng = np.random.default_rng(seed)
    rows = []
    while len(rows) < examples:
        text = docs[int(rng.integers(len(docs)))].text
        start = text.find("\n", int(rng.integers(len(text) - passage_chars))) + 1
        end = text.rfind("\n", start, start + passage_chars)
        passage = text[start:end if end > start else start + passage_chars]
        sents = _sentences(passage)
        pairs = [(a, b) for a, b in zip(sents, sents[1:]) if sents.count(a) == 1]
        if not pairs:
            continue
        first, nxt = pairs[int(rng.integers(len(pairs)))]
        question = (f"Here is a passage from a novel.\n\n{passage.strip()}\n\nIn the passage above, which sentence "
                    f"comes right after this one?\n\"{first}\"")
        rows.append({"messages": [{"role": "user", "content": question},
                                  {"role": "assistant", "content": f"\"{nxt}\""}]})
    return rows


def write_chat_novels(path: str | os.PathLike, examples: int, passage_chars: int = 60_000, seed: int = 0) -> Path:
    """Write :func:`chat_novel_examples` as JSON Lines to ``path`` (a new file or one this wrote; replaced
    atomically). Returns the path."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in chat_novel_examples(examples, passage_chars, seed)))
    os.replace(tmp, path)
    return path
