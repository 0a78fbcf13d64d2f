"""The error of unusable data or tokenizer."""

from __future__ import annotations

from typing import Callable

__all__ = ["DataError"]


class DataError(ValueError):
    """Unusable data or tokenizer. ``problem`` and ``fix`` are one clause each.

    Where the problem is the value of a data setting (a :class:`~oomb.config.DataConfig` field), ``setting`` names
    the field (``"tokenizer"``, ``"chat_template"``) and the message names it as the placeholder ``{tokenizer}``:
    ``problem`` and ``fix`` read it as the field name, and :meth:`parts` as its caller names it (the CLI: the flag,
    or the --config file's key where the value came from the file).
    """

    def __init__(self, problem: str, fix: str, setting: str | None = None) -> None:
        self.setting = setting
        self._template = (problem, fix)
        self.problem, self.fix = self.parts(lambda name: name)
        super().__init__(f"{self.problem}; {self.fix}")

    def parts(self, name: Callable[[str], str]) -> tuple[str, str]:
        """(problem, fix) with the ``{setting}`` placeholder as ``name(setting)``."""
        if self.setting is None:
            return self._template
        mark = "{" + self.setting + "}"
        problem, fix = (t.replace(mark, name(self.setting)) if mark in t else t for t in self._template)
        return problem, fix
