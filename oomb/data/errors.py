"""The error of unusable data or tokenizer."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """Unusable data or tokenizer. ``problem`` and ``fix`` are one clause each."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem = problem
        self.fix = fix
