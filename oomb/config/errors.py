"""The error every configuration check raises: which setting is wrong, the problem, and the fix.

A message names other settings as ``{field}`` placeholders, so one check reads right to each audience:
Python users see field names (``chunk_size``), YAML users the key path (``engine.chunk_size``), and the CLI
its flags (``--chunk-size``). :meth:`ConfigError.render` fills them in.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A setting that cannot be used.

    Args:
        key: the field at fault (``"chunk_size"``; a section's own field name, without its section).
        problem: what is wrong, with ``{name}`` placeholders for the settings it names.
        fix: what to do instead, with placeholders likewise.
        section: the section of ``key`` (``"engine"``, ``"engine.sparse"``, ``"train"``, ...), set by the
            section that raised it.

    ``str(error)`` renders the placeholders as field names: ``"problem; fix"``.
    """

    def __init__(self, key: str, problem: str, fix: str, section: str = "") -> None:
        self.key = key
        self.problem = problem
        self.fix = fix
        self.section = section
        super().__init__(self.render(lambda name: name))

    def render(self, name: Callable[[str], str]) -> str:
        """``"problem; fix"`` with each ``{field}`` placeholder replaced by ``name(field)``."""
        return f"{_fill(self.problem, name)}; {_fill(self.fix, name)}"

    def parts(self, name: Callable[[str], str]) -> tuple[str, str]:
        """(problem, fix), rendered with ``name`` as :meth:`render` does."""
        return _fill(self.problem, name), _fill(self.fix, name)


def _fill(text: str, name: Callable[[str], str]) -> str:
    out, i = [], 0
    while True:
        j = text.find("{", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        k = text.find("}", j)
        out.append(text[i:j])
        if k < 0:
            out.append(text[j:])
            return "".join(out)
        out.append(name(text[j + 1:k]))
        i = k + 1
