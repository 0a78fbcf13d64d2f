"""Plain text: text files, a folder or JSON Lines -> documents -> one token stream.

Documents are tokenised with a local Hugging Face tokenizer (never fetched from
a hub) and joined into one long token stream with the tokenizer's EOS token
between documents (:mod:`oomb.data.sequences` cuts it into sequences).

By default the bundled corpus (six Jane Austen novels, ~1.05M tokens) is used;
it ships inside the package under ``oomb/resources/``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError

__all__ = ["BUNDLED_CORPUS", "Document", "cache_dir", "load_documents", "tokenize_documents"]

_RESOURCES = Path(__file__).resolve().parent.parent / "resources"
BUNDLED_CORPUS = _RESOURCES / "austen"
"""Folder of the bundled corpus: six public-domain Jane Austen novels as UTF-8 .txt files."""


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


def cache_dir() -> Path:
    """oomb's cache folder: ``$OOMB_CACHE_DIR``, else ``$XDG_CACHE_HOME/oomb``, else ``~/.cache/oomb``."""
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
            path = cache_dir() / f"tokens-{_cache_key(docs, tokenizer)}.npy"
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


