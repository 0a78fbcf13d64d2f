"""Small value checks shared by the configuration sections; each raises :class:`ConfigError`."""

from __future__ import annotations

import math
from typing import Any, Sequence

from .errors import ConfigError


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_int(key: str, value: Any, unit: str = "") -> None:
    """``value`` an integer > 0, else ConfigError naming ``key`` and ``unit`` (e.g. 'tokens')."""
    if not is_int(value) or value <= 0:
        raise ConfigError(key, f"{{{key}}} is {value!r}", f"pass a positive {('number of ' + unit) if unit else 'integer'} for {{{key}}}")


def nonnegative_int(key: str, value: Any, unit: str = "", zero: str = "0") -> None:
    """``value`` an integer >= 0 (``zero`` says what 0 means in the fix)."""
    if not is_int(value) or value < 0:
        what = f"a positive number of {unit}" if unit else "a positive integer"
        raise ConfigError(key, f"{{{key}}} is {value!r}", f"pass {zero} or {what} for {{{key}}}")


def optional_positive_int(key: str, value: Any, unit: str) -> None:
    if value is not None and (not is_int(value) or value <= 0):
        raise ConfigError(key, f"{{{key}}} is {value!r}", f"pass a positive number of {unit}, or leave it out")


def positive_float(key: str, value: Any, fix: str) -> None:
    if not is_number(value) or not (value > 0 and math.isfinite(value)):
        raise ConfigError(key, f"{{{key}}} is {value!r}", fix)


def nonnegative_float(key: str, value: Any, fix: str) -> None:
    if not is_number(value) or value < 0 or not math.isfinite(value):
        raise ConfigError(key, f"{{{key}}} is {value!r}", fix)


def choice(key: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices or isinstance(value, bool) and not any(isinstance(c, bool) for c in choices):
        shown = ", ".join(repr(c) if isinstance(c, str) else str(c) for c in choices)
        raise ConfigError(key, f"{{{key}}} is {value!r}", f"pass one of {shown}")


def boolean(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(key, f"{{{key}}} is {value!r}", "pass true or false")


def power_of_two(key: str, value: Any, lo: int, hi: int) -> None:
    if value is not None and not (is_int(value) and lo <= value <= hi and value & (value - 1) == 0):
        raise ConfigError(key, f"{{{key}}} is {value!r}", f"pass a power of two from {lo} to {hi}, or leave it out for the default")
