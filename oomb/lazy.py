"""Package exports imported on first use (PEP 562): a package lists which of its submodules defines each public
name, and importing the package imports none of them, so that a light submodule (errors, path checks, file writers)
can be imported without the heavy ones (torch, transformers, the engine)."""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package`` (its ``__name__``), whose public names are
    the keys of ``exports`` (name -> the submodule, relative to the package, that defines it).

    ``__getattr__(name)`` imports the submodule the first time ``name`` is asked for and stores the value in
    ``namespace`` (the package's ``globals()``), so later lookups do not come back; it raises AttributeError for
    a name that is not exported.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
