"""The error every configuration check raises: which setting is wrong, the problem, and the fix.

A message names other settings as ``{field}`` placeholders, so one check reads right to each audience:
Python users see field names (``chunk_size``), YAML users the key path (``engine.chunk_size``), and the CLI
its flags (``--chunk-size``). :meth:`ConfigError.render` fills them in. A placeholder is a field name in braces;
``{{`` and ``}}`` are a literal brace (as in :meth:`str.format`), and a value shown in a message goes in as
:func:`literal` (its repr with its braces doubled), so that the braces of a mapping, a set or a string such as
``'{split}.jsonl'`` are printed as they are. True, False and None go in as a mark that renders as Python writes
them (``True``) or, for the YAML and CLI audience, as YAML does (``true``).
"""

from __future__ import annotations

import re
from typing import Any, Callable

__all__ = ["ConfigError", "literal"]


class ConfigError(ValueError):
    """A setting that cannot be used.

    Args:
        key: the field at fault (``"chunk_size"``; a section's own field name, without its section).
        problem: what is wrong, with ``{name}`` placeholders for the settings it names.
        fix: what to do instead, with placeholders likewise.
        section: the section of ``key`` (``"engine"``, ``"engine.sparse"``, ``"train"``, ...), set by the
            section that raised it.

    ``from_file`` is True for a configuration file's value refused although a flag overrides it (the file is
    told, not the flag).

    ``str(error)`` renders the placeholders as field names: ``"problem; fix"``.
    """

    def __init__(self, key: str, problem: str, fix: str, section: str = "") -> None:
        self.key = key
        self.problem = problem
        self.fix = fix
        self.section = section
        self.from_file = False
        super().__init__(self.render(lambda name: name))

    def render(self, name: Callable[[str], str], yaml: bool = False) -> str:
        """``"problem; fix"`` with each ``{field}`` placeholder replaced by ``name(field)``, and True, False and None
        (:func:`literal`) written as YAML writes them where ``yaml`` (``true``), else as Python does."""
        return "; ".join(self.parts(name, yaml))

    def parts(self, name: Callable[[str], str], yaml: bool = False) -> tuple[str, str]:
        """(problem, fix), rendered with ``name`` and ``yaml`` as :meth:`render` does."""
        return _fill(self.problem, name, yaml), _fill(self.fix, name, yaml)


def literal(value: Any) -> str:
    """``repr(value)`` as literal text of a :class:`ConfigError` message: its braces doubled, so that a mapping
    (``{'type': 'linear'}``) is shown as it is, not read as placeholders. True, False and None are a mark
    (``{=True}``) that :func:`_fill` writes as Python or as YAML does: a configuration file's ``true`` is told as
    ``true``, not as Python's ``True``."""
    if value is None or isinstance(value, bool):
        return f"{{={value!r}}}"
    return repr(value).replace("{", "{{").replace("}", "}}")


_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}|\{=(True|False|None)\}")
_YAML = {"True": "true", "False": "false", "None": "null"}


def _fill(text: str, name: Callable[[str], str], yaml: bool = False) -> str:
    """``text`` with each ``{field}`` replaced by ``name(field)``, each ``{=True}`` mark of :func:`literal` by the
    value as YAML (``yaml``) or Python writes it, and ``{{`` and ``}}`` by one brace; any other brace stays as it
    is."""
    def one(m: re.Match) -> str:
        if m.group(1) is not None:
            return name(m.group(1))
        if m.group(2) is not None:
            return _YAML[m.group(2)] if yaml else m.group(2)
        return m.group(0)[0]

    return _PLACEHOLDER.sub(one, text)
