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

from .build import build_training_data, detect_format, load_documents
from .errors import DataError
from .packing import PackedSequences, pack
from .sequences import Sample, TextSequences, TokenSequences, TrainingData, document_bounds
from .stats import DataStats
from .text import BUNDLED_CORPUS, Document, cache_dir, tokenize_documents
from .tokenizer import BUNDLED_TOKENIZER, load_tokenizer

__all__ = [
    "BUNDLED_CORPUS", "BUNDLED_TOKENIZER", "DataError", "DataStats", "Document", "PackedSequences", "Sample",
    "TextSequences", "TokenSequences", "TrainingData", "build_training_data", "cache_dir", "detect_format",
    "document_bounds", "load_documents", "load_tokenizer", "pack", "tokenize_documents",
]
