"""The tokenizer: a local Hugging Face tokenizer folder, loaded and checked to hold a real vocabulary."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

from .errors import DataError

__all__ = ["BUNDLED_TOKENIZER", "MIN_TOKENS", "load_tokenizer", "tokenizer_digest"]

BUNDLED_TOKENIZER = Path(__file__).resolve().parent.parent / "resources" / "tokenizer-sp32k"
"""Folder of the bundled tokenizer: 32,000-token SentencePiece BPE (Apache-2.0, LICENSE inside)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""A model folder holding one of these files holds its own tokenizer (a Hugging Face model, an 'oomb train' output,
a Llama or Mistral folder whose tokenizer is its SentencePiece tokenizer.model alone)."""

MIN_TOKENS = 256
"""The fewest tokens a usable tokenizer has: one per byte value (byte-level BPE); a folder that loads with
fewer (only its special tokens) has lost its vocabulary."""

_VOCAB_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "merges.txt")
_VOCAB_SUFFIXES = (".model", ".tiktoken")


def _has_vocabulary_file(root: Path) -> bool:
    return any(p.is_file() and (p.name in _VOCAB_FILES or p.suffix in _VOCAB_SUFFIXES or p.name.startswith("vocab."))
               for p in root.iterdir())


_LOADED: dict[tuple, bytes] = {}
"""Pickled tokenizers of the folders loaded in this process (at most :data:`_LOADED_MAX`), by :func:`_folder_key`."""
_LOADED_MAX = 4


def _folder_key(root: Path) -> tuple:
    """What a loaded tokenizer depends on: the folder (as given, since the tokenizer records its ``name_or_path``,
    and resolved) and every file in it by name, size, modification time and inode (a file rewritten or replaced
    is another key)."""
    files = []
    for p in root.iterdir():
        try:
            st = p.stat()
        except OSError:  # a broken link: what transformers would read there is absent
            files.append((p.name, -1, -1, -1))
            continue
        files.append((p.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return str(root), str(root.resolve()), tuple(sorted(files))


def load_tokenizer(path: str | os.PathLike | None = None):
    """Load a local Hugging Face tokenizer (``AutoTokenizer``, no network). ``None``: the bundled one.

    A folder is read once per process while its files are unchanged (each file's name, size, modification time
    and inode): a later call unpickles what the first loaded. Every call returns a new object of its own, which the
    caller may change (a chat template, added tokens) without another call's tokenizer changing with it.

    The class is the one the folder's ``tokenizer_config.json`` names, also when the folder is a model
    folder (an ``oomb train`` output) whose ``config.json`` would make ``AutoTokenizer`` pick another. A
    SentencePiece ``tokenizer.model`` without tokenizer.json (an older Llama or Mistral folder) is converted as
    transformers converts it, which needs the sentencepiece package.

    Raises:
        DataError: the folder does not exist, holds no vocabulary file (tokenizer.json, vocab.json, vocab.txt,
            merges.txt, a SentencePiece ``*.model`` or ``*.tiktoken``), holds no loadable tokenizer (a
            tokenizer.model alone without sentencepiece installed, or one it cannot read), or the tokenizer has
            fewer than :data:`MIN_TOKENS` tokens.
    """
    from transformers import AutoTokenizer, PretrainedConfig

    root = BUNDLED_TOKENIZER if path is None else Path(path)
    setting = None if path is None else "tokenizer"  # the bundled one is no setting of the user's
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise DataError(f"tokenizer folder {str(root)!r} {what}",
                        "set {tokenizer} to a local folder with tokenizer.json (or leave it out for the bundled tokenizer)",
                        setting=setting)
    if not _has_vocabulary_file(root):
        raise DataError(
            f"cannot load a tokenizer from {str(root)!r}: the folder has no vocabulary (no tokenizer.json, "
            "vocab.json, vocab.txt or SentencePiece .model file)",
            "set {tokenizer} to the folder a Hugging Face tokenizer's save_pretrained wrote, with its vocabulary files",
            setting=setting)
    if not (root / "tokenizer.json").is_file() and (root / "tokenizer.model").is_file():
        _check_sentencepiece(root / "tokenizer.model", setting)
    key = _folder_key(root)
    cached = _LOADED.get(key)
    if cached is not None:
        return pickle.loads(cached)
    try:
        # An empty config: the class comes from the folder's tokenizer_config.json (or tokenizer.json), never
        # from a config.json beside it. A trained oomb output holds both, and transformers >= 5.2x swaps in the
        # model type's tokenizer class (Qwen2Tokenizer for a qwen2 config), which splits the bundled
        # SentencePiece vocabulary's text differently ('truth' -> 'tr', 'uth', spaces lost). A tokenizer.model
        # alone is converted by the generic class, as AutoTokenizer converts a Llama or Mistral folder's.
        tokenizer = AutoTokenizer.from_pretrained(str(root), local_files_only=True, config=PretrainedConfig())
    except (OSError, ValueError, TypeError, KeyError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"cannot load a tokenizer from {str(root)!r} ({first_line})",
            "set {tokenizer} to a folder written by a Hugging Face tokenizer's save_pretrained", setting=setting,
        ) from exc
    if len(tokenizer) < MIN_TOKENS:
        raise DataError(
            f"the tokenizer in {str(root)!r} has only {len(tokenizer)} tokens (a model's tokenizer has thousands; "
            "its vocabulary did not load)",
            "set {tokenizer} to the model's own tokenizer folder, with its tokenizer.json", setting=setting)
    # Kept pickled, not as the object: the caller may change the one returned. Unpickling takes about a third of
    # the load (which parses tokenizer.json several times); a tokenizer that cannot be pickled is loaded anew.
    try:
        state = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - any failure to pickle only means not kept
        return tokenizer
    while len(_LOADED) >= _LOADED_MAX:
        del _LOADED[next(iter(_LOADED))]  # the first kept
    _LOADED[key] = state
    return tokenizer


def _check_sentencepiece(model: Path, setting: str | None) -> None:
    """Refuse the SentencePiece file ``model`` (the tokenizer.model of a folder without tokenizer.json) where
    transformers cannot convert it: without the sentencepiece package (transformers then tries it as a tiktoken
    file and fails naming tiktoken), or where sentencepiece cannot read it.

    Raises:
        DataError: naming the file, and the package to install or the folder to pass instead.
    """
    try:
        import sentencepiece
    except ImportError:
        raise DataError(
            f"the tokenizer {str(model)!r} is a SentencePiece model, which transformers reads only with the "
            "sentencepiece package, and that is not installed",
            "pip install sentencepiece, or set {tokenizer} to a folder with the model's tokenizer.json",
            setting=setting) from None
    try:
        sentencepiece.SentencePieceProcessor(model_file=str(model))
    except (RuntimeError, OSError, ValueError, TypeError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"cannot load the tokenizer {str(model)!r}: sentencepiece cannot read it ({first_line})",
            "replace it with the model's own tokenizer.model, or set {tokenizer} to a folder with the model's "
            "tokenizer.json", setting=setting) from exc


def tokenizer_digest(tokenizer) -> bytes:
    """What identifies a tokenizer's encoding: its class, its backend's serialised form and its EOS id (bytes
    for a hash)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(tokenizer)
    return f"{type(tokenizer).__name__}\0{tokenizer.eos_token_id}\0{text}".encode()
