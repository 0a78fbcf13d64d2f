"""Training data: local files -> rows (text, chat messages, prompt/completion) -> token sequences with labels.

:func:`load_tokenizer` (:mod:`~oomb.data.tokenizer`) reads a local tokenizer folder and refuses one without a
vocabulary; :func:`build_training_data` (:mod:`~oomb.data.build`) reads a :class:`oomb.config.DataConfig`'s
data (:mod:`~oomb.data.sources`), renders chat rows with per-token labels (:mod:`~oomb.data.chat`), packs
them (:mod:`~oomb.data.packing`) and counts what it made (:mod:`~oomb.data.stats`); the training loop reads
:class:`Sample` objects from the result (:mod:`~oomb.data.sequences`). :func:`load_documents` reads the same
data as plain-text documents (eval, grad-error, the needle haystack).

By default the bundled corpus (six Jane Austen novels, ~1.05M tokens) and the bundled 32,000-token
SentencePiece tokenizer are used; both ship inside the package under ``oomb/resources/``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

_EXPORTS = {
    "build_training_data": "build", "detect_format": "build", "load_documents": "build",
    "DataError": "errors",
    "PackedSequences": "packing", "pack": "packing",
    "Sample": "sequences", "TextSequences": "sequences", "TokenSequences": "sequences", "TrainingData": "sequences",
    "document_bounds": "sequences",
    "DataStats": "stats",
    "data_splits": "sources",
    "BUNDLED_CORPUS": "text", "Document": "text", "cache_dir": "text", "tokenize_documents": "text",
    "BUNDLED_TOKENIZER": "tokenizer", "load_tokenizer": "tokenizer",
}
"""Name -> the submodule that defines it. The submodules are imported when a name is first asked for (PEP 562), so
that ``oomb.data.errors`` or ``oomb.data.sources`` can be imported without torch: the command line checks a --data
path before its heavy imports."""

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .build import build_training_data, detect_format, load_documents
    from .errors import DataError
    from .packing import PackedSequences, pack
    from .sequences import Sample, TextSequences, TokenSequences, TrainingData, document_bounds
    from .sources import data_splits
    from .stats import DataStats
    from .text import BUNDLED_CORPUS, Document, cache_dir, tokenize_documents
    from .tokenizer import BUNDLED_TOKENIZER, load_tokenizer


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
