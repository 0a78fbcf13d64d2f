"""The ``oomb`` command line: ``oomb train`` fine-tunes a causal LM on long sequences; ``oomb plan``,
``oomb grad-error``, ``oomb eval`` and ``oomb bench`` size and measure runs.

Every input is checked before anything is written: a bad input ends the program with exit status 2 and one line
on stderr, ``oomb: error: <problem>; <fix>``, and leaves an existing output directory as it was. The trained model
(or LoRA adapter) is written to a temporary directory inside the output directory and moved into place only when
complete. The flags are generated from the configuration fields (:mod:`oomb.config`); only this package speaks in
flags.
"""

from .errors import UsageError
from .main import main
from .parser import META_FLAGS, _build_parser  # noqa: F401 - the parser, for tests and docs tools

__all__ = ["META_FLAGS", "UsageError", "main"]
