"""Training data: text files, a folder or JSON Lines -> one token stream -> fixed-length sequences.

Documents are tokenised with a local Hugging Face tokenizer (never fetched from
a hub), joined into one long token stream with the tokenizer's EOS token
between documents, and cut into consecutive, non-overlapping sequences of
``seq_len`` tokens (the tail shorter than ``seq_len`` is dropped). Labels are
the input ids themselves; the engine shifts them across the whole sequence.

By default the bundled corpus (six Jane Austen novels, ~1.05M tokens) and the
bundled 32,000-token SentencePiece tokenizer are used; both ship inside the
package under ``oomb/resources/``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

__all__ = [
    "BUNDLED_CORPUS",
    "BUNDLED_TOKENIZER",
    "DataError",
    "Document",
    "TokenSequences",
    "load_documents",
    "load_tokenizer",
    "tokenize_documents",
]

_RESOURCES = Path(__file__).resolve().parent / "resources"
BUNDLED_CORPUS = _RESOURCES / "austen"
"""Folder of the bundled corpus: six public-domain Jane Austen novels as UTF-8 .txt files."""
BUNDLED_TOKENIZER = _RESOURCES / "tokenizer-sp32k"
"""Folder of the bundled tokenizer: 32,000-token SentencePiece BPE (Apache-2.0, LICENSE inside)."""


class DataError(ValueError):
    """Unusable data or tokenizer. ``problem`` and ``fix`` are one clause each."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem = problem
        self.fix = fix


@dataclass(frozen=True)
class Document:
    """One document: where it came from (``path`` or ``path:line``) and its text."""

    source: str
    text: str


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})", "convert it to UTF-8") from exc
    except OSError as exc:
        raise DataError(f"cannot read {path} ({exc.strerror})", "check the path and its permissions") from exc


def _read_jsonl(path: Path) -> list[Document]:
    docs = []
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno} is not valid JSON ({exc.msg})", 'write one JSON object per line, e.g. {"text": "..."}') from exc
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'{path}:{lineno} has no string "text" field', 'write one JSON object per line, e.g. {"text": "..."}')
        docs.append(Document(f"{path}:{lineno}", record["text"]))
    return docs


def load_documents(path: str | os.PathLike | None = None) -> list[Document]:
    """Read the documents of a text file, a ``.jsonl`` file or a folder.

    Args:
        path: a ``.jsonl`` file (one JSON object per line with a ``"text"``
            field; each line is a document), any other file (read as UTF-8
            text, one document), or a folder (every ``*.txt`` and ``*.jsonl``
            file directly inside it, sorted by name). ``None``: the bundled corpus.

    Returns:
        The documents in order. Empty documents (only whitespace) are dropped.

    Raises:
        DataError: the path does not exist, a folder holds no data file, a file
            is not UTF-8 or not valid JSON Lines, or every document is empty.
    """
    root = BUNDLED_CORPUS if path is None else Path(path)
    if not root.exists():
        raise DataError(f"data path {str(root)!r} does not exist", "pass --data a text file, a .jsonl file or a folder of .txt files")
    if root.is_dir():
        files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in (".txt", ".jsonl"))
        if not files:
            raise DataError(f"folder {str(root)!r} holds no .txt or .jsonl file", "put the training text in .txt files (or .jsonl with a \"text\" field) there")
    else:
        files = [root]
    docs: list[Document] = []
    for file in files:
        if file.suffix == ".jsonl":
            docs.extend(_read_jsonl(file))
        else:
            docs.append(Document(str(file), _read_text(file)))
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise DataError(f"data {str(root)!r} is empty (no non-blank text)", "give it some text to train on")
    return docs


def load_tokenizer(path: str | os.PathLike | None = None):
    """Load a local Hugging Face tokenizer (``AutoTokenizer``, no network). ``None``: the bundled one.

    The class is the one the folder's ``tokenizer_config.json`` names, also when the folder is a model
    folder (an ``oomb train`` output) whose ``config.json`` would make ``AutoTokenizer`` pick another.

    Raises:
        DataError: the folder does not exist or holds no loadable tokenizer.
    """
    from transformers import AutoTokenizer, PretrainedConfig

    root = BUNDLED_TOKENIZER if path is None else Path(path)
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise DataError(f"tokenizer folder {str(root)!r} {what}", "pass --tokenizer a local folder with tokenizer.json (or omit it for the bundled tokenizer)")
    try:
        # An empty config: the class comes from the folder's tokenizer_config.json (or tokenizer.json), never
        # from a config.json beside it. A trained oomb output holds both, and transformers >= 5.2x swaps in the
        # model type's tokenizer class (Qwen2Tokenizer for a qwen2 config), which splits the bundled
        # SentencePiece vocabulary's text differently ('truth' -> 'tr', 'uth', spaces lost).
        return AutoTokenizer.from_pretrained(str(root), local_files_only=True, config=PretrainedConfig())
    except (OSError, ValueError, TypeError, KeyError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"cannot load a tokenizer from {str(root)!r} ({first_line})",
            "pass --tokenizer a folder written by a Hugging Face tokenizer's save_pretrained",
        ) from exc


def _cache_dir() -> Path:
    base = os.environ.get("OOMB_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "oomb")
    return Path(base)


def _cache_key(docs: list[Document], tokenizer) -> str:
    h = hashlib.sha256()
    h.update(b"oomb-tokens-v1\0")
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else repr(tokenizer)).encode())
    h.update(str(tokenizer.eos_token_id).encode())
    for d in docs:
        h.update(hashlib.sha256(d.text.encode()).digest())
    return h.hexdigest()[:32]


def tokenize_documents(docs: list[Document], tokenizer, cache: bool = False) -> np.ndarray:
    """Tokenise ``docs`` into one stream, the tokenizer's EOS id between documents.

    Args:
        docs: documents from :func:`load_documents`.
        tokenizer: a Hugging Face tokenizer. No BOS/EOS is added inside a document.
        cache: keep the result as ``.npy`` in ``$OOMB_CACHE_DIR`` (default
            ``~/.cache/oomb``), keyed by a hash of the texts and the tokenizer;
            a failure to read or write the cache is ignored.

    Returns:
        int64 array ``[N]`` of token ids.
    """
    path = None
    if cache:
        try:
            path = _cache_dir() / f"tokens-{_cache_key(docs, tokenizer)}.npy"
            if path.is_file():
                return np.load(path)
        except (OSError, ValueError):
            path = None
    encoded = tokenizer([d.text for d in docs], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    parts: list[np.ndarray] = []
    for i, ids in enumerate(encoded):
        if i > 0 and eos is not None:
            parts.append(np.array([eos], dtype=np.int64))
        parts.append(np.asarray(ids, dtype=np.int64))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
            np.save(tmp, tokens)
            os.replace(tmp, path)
        except OSError:
            pass
    return tokens


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
        return torch.from_numpy(np.ascontiguousarray(chunk)).view(1, -1)

    def order(self, epoch: int) -> np.ndarray:
        """The seeded permutation of sequence indices for ``epoch`` (0-based)."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)

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
