"""What the flag generator and the YAML reader need to know about a configuration field.

A field's metadata may name its flag (``flag("--offload")``), say it has none (``flag(None)``: settable from
Python and YAML only), or give a metavar, a flag-only spelling of its values, or the flag's own help. Without
metadata the flag is ``--`` + the field name with dashes, prefixed by the section's flag prefix where the section
has one. The help text of a flag is the field's docstring (the string literal under the field), read from the
source, unless the metadata gives its own.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from functools import lru_cache
from typing import Any

__all__ = ["field_docs", "flag"]

_NO_FLAG = object()


def flag(name: str | None, metavar: str | None = None, **extra: Any) -> dict:
    """Field metadata: the flag ``name`` (None: no flag), an optional ``metavar``, and ``extra`` keys
    (``optional_const``: the value a bare flag means, for ``--resume``; ``help``: the flag's help where the
    field's docstring speaks of Python values, e.g. None, that a flag user never writes)."""
    meta = {"flag": name if name is not None else _NO_FLAG}
    if metavar:
        meta["metavar"] = metavar
    meta.update(extra)
    return meta


def has_no_flag(f: dataclasses.Field) -> bool:
    return f.metadata.get("flag", None) is _NO_FLAG


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring, whitespace folded} of dataclass ``cls`` (the string under each field)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
