"""Small value checks shared by the configuration sections; each raises :class:`ConfigError`."""

from __future__ import annotations

import dataclasses
import math
import os
import types as types_
import typing
from functools import cache
from typing import Any, Literal, Sequence, get_args, get_origin

from .errors import ConfigError, literal


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_int(key: str, value: Any, unit: str = "") -> None:
    """``value`` an integer > 0, else ConfigError naming ``key`` and ``unit`` (e.g. 'tokens')."""
    if not is_int(value) or value <= 0:
        raise ConfigError(key, f"{{{key}}} is {literal(value)}", f"pass a positive {('number of ' + unit) if unit else 'integer'} for {{{key}}}")


def nonnegative_int(key: str, value: Any, unit: str = "", zero: str = "0") -> None:
    """``value`` an integer >= 0 (``zero`` says what 0 means in the fix)."""
    if not is_int(value) or value < 0:
        what = f"a positive number of {unit}" if unit else "a positive integer"
        raise ConfigError(key, f"{{{key}}} is {literal(value)}", f"pass {zero} or {what} for {{{key}}}")


def optional_positive_int(key: str, value: Any, unit: str) -> None:
    if value is not None and (not is_int(value) or value <= 0):
        raise ConfigError(key, f"{{{key}}} is {literal(value)}", f"pass a positive number of {unit}, or leave it out")


def positive_float(key: str, value: Any, fix: str) -> None:
    if not is_number(value) or not (value > 0 and math.isfinite(value)):
        raise ConfigError(key, f"{{{key}}} is {literal(value)}", fix)


def nonnegative_float(key: str, value: Any, fix: str) -> None:
    if not is_number(value) or value < 0 or not math.isfinite(value):
        raise ConfigError(key, f"{{{key}}} is {literal(value)}", fix)


def choice(key: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices or isinstance(value, bool) and not any(isinstance(c, bool) for c in choices):
        shown = ", ".join(repr(c) if isinstance(c, str) else str(c) for c in choices)
        raise ConfigError(key, f"{{{key}}} is {literal(value)}", f"pass one of {shown}")


def boolean(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(key, f"{{{key}}} is {literal(value)}", "pass true or false")


def power_of_two(key: str, value: Any, lo: int, hi: int) -> None:
    if value is not None and not (is_int(value) and lo <= value <= hi and value & (value - 1) == 0):
        raise ConfigError(key, f"{{{key}}} is {literal(value)}", f"pass a power of two from {lo} to {hi}, or leave it out for the default")


def types(obj: Any) -> None:
    """Each field of dataclass ``obj`` holds a value of its declared type (:func:`field_type`), checked before any
    range or relation check, so that a value of the wrong kind is told as such.

    Raises:
        ConfigError: what :func:`field_type` raises, for the first field of the wrong type.
    """
    for f in dataclasses.fields(obj):
        field_type(type(obj), f, getattr(obj, f.name))


def field_type(cls: type, f: dataclasses.Field, value: Any) -> None:
    """``value`` is of the declared type of field ``f`` of dataclass ``cls``. Types checked: ``int`` (not bool),
    ``float`` (an int too), ``bool``, ``str``, a ``Literal`` (:func:`choice`), and ``Optional`` and ``List`` of
    those; fields of other types (sections) are left to their own checks.

    Raises:
        ConfigError: ``"{key} is 'abc'"; "it takes an integer (e.g. {key} 2048)"``: what the field takes, with
            its default as the example (none for a bool; "or leave it out" where the default is None).
    """
    tp = _hints(cls).get(f.name)
    optional = False
    if get_origin(tp) in _UNIONS:
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) != 1:
            return
        tp, optional = args[0], True
        if value is None:
            return
    if get_origin(tp) is Literal:
        choice(f.name, value, get_args(tp))
        return
    item = get_args(tp)[0] if get_origin(tp) is list else None
    what = _TAKES.get(item if item is not None else tp)
    if what is None or _fits(value, tp):
        return
    if item is not None:
        what = f"a list of {_PLURAL[item]}"
    factory = f.default_factory
    default = factory() if factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
    if default is None or default is dataclasses.MISSING or default == [] or tp is bool:
        example = ", or leave it out" if optional else ""
    else:
        shown = " ".join(map(_shown, default)) if isinstance(default, list) else _shown(default)
        example = f" (e.g. {{{f.name}}} {shown})"
    raise ConfigError(f.name, f"{{{f.name}}} is {literal(value)}", f"it takes {what}{example}")


_UNIONS = (typing.Union, getattr(types_, "UnionType", typing.Union))
_TAKES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_PLURAL = {int: "integers", float: "numbers", bool: "true or false values", str: "strings"}


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fits(value: Any, tp: Any) -> bool:
    if get_origin(tp) is list:
        (item,) = get_args(tp)
        return isinstance(value, (list, tuple)) and all(_fits(v, item) for v in value)
    if get_origin(tp) is Literal:
        return True  # each item is checked by the section (choice)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return is_int(value)
    if tp is float:
        return is_number(value)
    if tp is str:
        return isinstance(value, (str, os.PathLike))  # a path field may be given a pathlib.Path from Python
    return True


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
