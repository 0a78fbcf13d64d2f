"""How a bad input ends the program: :class:`UsageError` (exit status 2) and its run-time kin (status 1), one line on stderr."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class UsageError(Exception):
    """A bad input: ``problem`` and ``fix`` are printed on one line; exit status 2."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem = problem
        self.fix = fix


class _RunError(UsageError):
    """Training failed after it started (out of memory, diverged): one line, exit status 1."""


def _named(args: argparse.Namespace | None, key: str, flag: str) -> str:
    """How the user gave the setting ``key`` (``"output.dir"``): ``key (in FILE)`` where its value came from the
    --config file, else ``flag``."""
    config = getattr(args, "_config_file", None)
    if config is not None and key in getattr(args, "_config_keys", ()):
        return f"{key} (in {config})"
    return flag


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _allocation_refusal(exc: BaseException, what: str = "for --seq-len, --chunk-size and --page-size") -> UsageError | None:
    """The one-line refusal of a memory allocation that failed before a command's work began (the CPU allocator's
    ``RuntimeError``, "DefaultCPUAllocator: can't allocate memory", or a GPU ``OutOfMemoryError`` no command caught),
    naming the bytes asked for where PyTorch's message gives them and ``what`` they were for; None for any other
    exception."""
    import re

    from ..memory import is_out_of_memory

    if not is_out_of_memory(exc):
        return None
    asked = re.search(r"allocate (\d+) bytes", str(exc))
    size = f" {int(asked.group(1)) / 2**30:,.1f} GiB" if asked else ""
    where = "host" if "can't allocate memory" in str(exc) else "GPU"
    return UsageError(f"could not allocate{size} of {where} memory {what}",
                      "use a shorter --seq-len or a smaller --chunk-size or --page-size (a page or chunk is allocated "
                      "whole, even past the sequence's end), or a machine with more memory")


def _fail(message: str, status: int = 2) -> NoReturn:
    print(f"oomb: error: {_one_line(message)}", file=sys.stderr)
    raise SystemExit(status)
