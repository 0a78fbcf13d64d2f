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


def _named(args: argparse.Namespace | None, key: str, flag: str, file: bool = True) -> str:
    """How the user gave the setting ``key`` (``"output.dir"``): ``key (in FILE)`` where its value came from the
    --config file (``key`` alone where ``file`` is false: the file already named), else ``flag``."""
    config = getattr(args, "_config_file", None)
    if config is not None and key in getattr(args, "_config_keys", ()):
        return f"{key} (in {config})" if file else key
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


CUT_SHORT = "a write was cut short, as on a full disk"
""":func:`_disk_full`'s reason for torch.save's short write (its writer keeps no errno)."""


def _disk_full(exc: BaseException) -> str | None:
    """Why a write failed where the disk is full or the quota spent: "the disk is full (No space left on device)",
    "the disk quota is exceeded (Disk quota exceeded)", or :data:`CUT_SHORT` for torch.save's writer RuntimeError of
    a short write; ``exc`` an OSError, safetensors' SafetensorError or that RuntimeError. None for anything else."""
    import errno

    text = _one_line(exc)
    code = exc.errno if isinstance(exc, OSError) else None
    if code == errno.ENOSPC or "No space left on device" in text or "os error 28" in text:
        return "the disk is full (No space left on device)"
    if code == errno.EDQUOT or "Disk quota exceeded" in text or "os error 122" in text:
        return "the disk quota is exceeded (Disk quota exceeded)"
    if isinstance(exc, RuntimeError) and "unexpected pos" in text and \
            ("inline_container" in text or "PytorchStreamWriter" in text):
        return CUT_SHORT
    return None


def _out_of_space(exc: BaseException) -> str | None:
    """The problem of the one-line error of a command's output write that a full disk or spent quota stopped
    (:func:`_disk_full`), naming the file where the error does; None for any other exception."""
    reason = _disk_full(exc)
    if reason is None:
        return None
    where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename else ""
    return f"a file cannot be written{where}: {reason}"


def _fail(message: str, status: int = 2) -> NoReturn:
    # One write of the whole line: under torchrun the ranks share stderr, and print's separate write of the newline
    # (stderr unbuffered) let another rank's line run into this one.
    sys.stderr.write(f"oomb: error: {_one_line(message)}\n")
    sys.stderr.flush()
    raise SystemExit(status)
