"""Plain text: text files -> documents -> one token stream; oomb's cache folder.

Documents are tokenised with a local Hugging Face tokenizer (never fetched from
a hub) and joined into one long token stream with the tokenizer's EOS token
between documents (:mod:`oomb.data.sequences` cuts it into sequences).

By default the bundled corpus (six Jane Austen novels, ~1.05M tokens) is used;
it ships inside the package under ``oomb/resources/``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError

__all__ = ["BUNDLED_CORPUS", "Document", "cache_dir", "cache_folder", "compressed", "not_utf8", "read_documents",
           "tokenize_documents"]

_RESOURCES = Path(__file__).resolve().parent.parent / "resources"
BUNDLED_CORPUS = _RESOURCES / "austen"
"""Folder of the bundled corpus: six public-domain Jane Austen novels as UTF-8 .txt files."""


@dataclass(frozen=True)
class Document:
    """One document: where it came from (``path`` or ``path:line``) and its text."""

    source: str
    text: str


def not_utf8(where: str, exc: UnicodeDecodeError) -> DataError:
    """The DataError of text at ``where`` (a file, or ``file:line``) that is not UTF-8."""
    return DataError(f"{where} is not UTF-8 text ({exc.reason} at byte {exc.start})", "convert it to UTF-8")


_COMPRESSIONS = ((b"\x1f\x8b", "gzip", ".gz", "gunzip -k"), (b"\x28\xb5\x2f\xfd", "zstd", ".zst", "zstd -d"),
                 (b"\xfd7zXZ\x00", "xz", ".xz", "unxz -k"), (b"BZh", "bzip2", ".bz2", "bunzip2 -k"))
"""The compressed formats known by their first bytes: (magic, name, suffix, the command that decompresses FILE.SUFFIX
into FILE and keeps FILE.SUFFIX)."""

COMPRESSED_SUFFIXES = tuple(suffix for _, _, suffix, _ in _COMPRESSIONS)
"""The suffixes of the compressed formats (``.gz``, ``.zst``, ...), by which a folder's compressed data files
(``b.jsonl.gz``) are found before their first bytes are read."""


def compression_of(path: Path) -> tuple[str, str, str] | None:
    """The compressed format of the file ``path``, known by its first bytes: ``_COMPRESSIONS``'s row without the
    magic (name, suffix, keep); None for any other file, or one that cannot be read."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError:
        return None
    for magic, *found in _COMPRESSIONS:
        # bzip2: "BZh" and the block size, 1 to 9
        if head.startswith(magic) and (magic != b"BZh" or head[3:4] in [b"%d" % k for k in range(1, 10)]):
            return tuple(found)
    return None


def compressed(path: Path) -> DataError | None:
    """The DataError of a file that is gzip, zstd, xz or bzip2 compressed (known by its first bytes, whatever its
    name), which oomb reads only decompressed, with the command that decompresses it and keeps the compressed
    file: into the name without its compression suffix (``chat.jsonl.gz`` -> ``chat.jsonl``), or, for a name
    without one, into its own name once the compressed file is renamed to have it; None for any other file, or
    one that cannot be read."""
    import shlex

    found = compression_of(path)
    if found is None:
        return None
    name, suffix, keep = found
    problem = f"{path} is {name}-compressed, and oomb reads data files uncompressed only"
    if path.name.lower().endswith(suffix) and len(path.name) > len(suffix):
        plain = path.with_name(path.name[:-len(suffix)])
        return DataError(problem, f"decompress it: {keep} {shlex.quote(str(path))}, and pass --data "
                                  f"{shlex.quote(str(plain))}, the file it writes")
    packed = shlex.quote(str(path) + suffix)
    return DataError(problem, f"decompress it under its own name: mv -n {shlex.quote(str(path))} {packed} && "
                              f"{keep} {packed} (which keeps {packed}), and run the command again")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise compressed(path) or not_utf8(str(path), exc) from exc
    except OSError as exc:
        raise DataError(f"cannot read {path} ({exc.strerror})", "check the path and its permissions") from exc


def read_documents(files: list[Path], root: Path) -> list[Document]:
    """The plain-text reader: each of ``files`` (UTF-8 text) is one document; ``root`` (the file or folder the
    user named) is named where no document has non-blank text. Blank documents are dropped.

    Raises:
        DataError: a file is not UTF-8 or cannot be read, or every document is blank.
    """
    docs = [Document(str(f), _read_text(f)) for f in files]
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise DataError(f"data {str(root)!r} is empty (no non-blank text)", "pass --data a file or folder that holds text")
    return docs


def cache_dir() -> Path:
    """oomb's cache folder: ``$OOMB_CACHE_DIR``, else ``$XDG_CACHE_HOME/oomb``, else ``~/.cache/oomb``."""
    base = os.environ.get("OOMB_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "oomb")
    return Path(base)


def cache_folder(*parts: str) -> Path:
    """The folder ``cache_dir()/parts``, made where missing.

    Raises:
        DataError: it cannot be made (the cache folder is a file, or not writable), naming the variable it came
            from (OOMB_CACHE_DIR, XDG_CACHE_HOME) and what to set.
    """
    path = cache_dir().joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        base = cache_dir()
        given = next((v for v in ("OOMB_CACHE_DIR", "XDG_CACHE_HOME") if os.environ.get(v)), None)
        what = f"{given} {os.environ[given]!r}" if given else f"the cache folder {str(base)!r}"
        reason = exc.strerror or type(exc).__name__
        raise DataError(f"oomb's cache folder cannot be made in {what} ({reason}: {exc.filename or path})",
                        "set OOMB_CACHE_DIR to a folder oomb may write to (made where missing)") from exc
    return path


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
        docs: documents (:func:`oomb.data.load_documents`).
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


