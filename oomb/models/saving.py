"""Writing a tokenizer into a model folder so that ``AutoTokenizer.from_pretrained(folder)`` gives the same token
ids as the tokenizer that was saved.

transformers 5.x does not always load the class a folder's ``tokenizer_config.json`` names: for some model types
(``qwen2`` among them; ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`` in ``transformers.models.auto.
tokenization_auto``) it builds the model type's own tokenizer class from the vocabulary alone, with that class's
normalizer and pre-tokenizer. A tiny Qwen2 preset trained with the bundled SentencePiece tokenizer then reloads as
a byte-level ``Qwen2Tokenizer`` that splits words differently (``'truth'`` -> ``'tr', 'uth'``, spaces dropped).

:func:`save_tokenizer` names the generic class (``TokenizersBackend``: the ``tokenizer.json`` pipeline as it is)
and, only where ``AutoTokenizer`` would still build another pipeline for this folder, adds an ``auto_map`` entry
and a module of one subclass of ``TokenizersBackend`` (:data:`TOKENIZER_MODULE`). An ``auto_map`` makes
``AutoTokenizer`` skip the model type's class: without ``trust_remote_code`` it loads ``TokenizersBackend``,
with it that subclass, and both read ``tokenizer.json`` unchanged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["TOKENIZER_MODULE", "save_tokenizer"]

TOKENIZER_MODULE = "tokenization_oomb.py"
"""The module :func:`save_tokenizer` writes where ``auto_map`` is needed."""

_MODULE_TEXT = '''"""The tokenizer of this folder: tokenizer.json as it is (see oomb.models.saving)."""

from transformers import TokenizersBackend


class OOMBTokenizer(TokenizersBackend):
    """``TokenizersBackend`` under a name ``auto_map`` can point at; loads tokenizer.json unchanged."""
'''

_GENERIC = "TokenizersBackend"


def _pipeline(tokenizer) -> str | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend.to_str() if backend is not None else None


def _auto_pipeline(folder: Path) -> str | None:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # transformers' notes on the class it picks: this probe is not the user's load
    try:
        return _pipeline(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
    finally:
        hf_logging.set_verbosity(verbosity)


_RESOLVED: dict[str, bool] = {}
"""Folders this process has checked, by :func:`_resolution_key`: whether ``AutoTokenizer`` needed the ``auto_map``
entry to rebuild the saved pipeline. ``AutoTokenizer`` picks the class from these files alone, so a folder with the
same files resolves the same way; probing it again (two tokenizer loads, ~0.7 s for the bundled one) is skipped."""


def _resolution_key(folder: Path) -> str:
    """A digest of what ``AutoTokenizer`` reads to pick a folder's tokenizer class and pipeline: the model's
    ``config.json`` and every tokenizer file ``save_pretrained`` wrote, with the transformers version."""
    import hashlib

    import transformers

    digest = hashlib.sha256(transformers.__version__.encode())
    for path in sorted(folder.iterdir()):
        if path.is_file() and (path.name == "config.json" or path.name.startswith(("tokenizer", "special_tokens",
                                                                                   "added_tokens", "vocab", "merges"))):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def save_tokenizer(tokenizer, folder: str | os.PathLike) -> None:
    """Save ``tokenizer`` (a transformers tokenizer with a ``tokenizers`` backend) into ``folder`` so that
    ``AutoTokenizer.from_pretrained(folder)`` rebuilds the same pipeline, with or without ``trust_remote_code``.

    Save the model (its ``config.json``) into ``folder`` first: which class ``AutoTokenizer`` picks depends on it.
    The check that it does loads the folder with ``AutoTokenizer``; a folder whose files equal those of one checked
    before in this process (each checkpoint of a run) is written as that one was, without loading it again.

    Raises:
        RuntimeError: ``AutoTokenizer`` still builds another pipeline from the folder (a transformers version
            whose resolution this module does not know); the files are written (save into a temporary folder).
    """
    folder = Path(folder)
    tokenizer.save_pretrained(str(folder))
    want = _pipeline(tokenizer)
    if want is None:
        return
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = _GENERIC
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    key = _resolution_key(folder)
    needs_auto_map = _RESOLVED.get(key)
    if needs_auto_map is None:
        needs_auto_map = _auto_pipeline(folder) != want
    if needs_auto_map:
        cfg["auto_map"] = {"AutoTokenizer": [None, f"{Path(TOKENIZER_MODULE).stem}.OOMBTokenizer"]}
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
        (folder / TOKENIZER_MODULE).write_text(_MODULE_TEXT)
        if key not in _RESOLVED and _auto_pipeline(folder) != want:
            raise RuntimeError(f"AutoTokenizer.from_pretrained({str(folder)!r}) does not rebuild the saved tokenizer")
    _RESOLVED[key] = needs_auto_map
