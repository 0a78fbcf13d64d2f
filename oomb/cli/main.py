"""The entry point of the ``oomb`` command."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Sequence

from .data import _data
from .errors import UsageError, _allocation_refusal, _fail, _out_of_space, _RunError
from .measure import _bench, _eval, _grad_error
from .parser import _build_parser, _given_parser, _job_config, _namespace
from .plan import _plan
from .signals import _StartupSignals
from .train import _train

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """``warnings.showwarning`` of the CLI: oomb's own warnings as one ``oomb: warning: ...`` line (no source
    line, which names the CLI's code, not the user's input); other libraries' warnings as Python prints them."""
    if os.path.abspath(filename).startswith(_PACKAGE_DIR) and issubclass(category, UserWarning):
        print(f"oomb: warning: {message}", file=sys.stderr if file is None else file)
    else:
        _DEFAULT_SHOWWARNING(message, category, filename, lineno, file, line)


_DEFAULT_SHOWWARNING = warnings.showwarning


_QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
"""Loggers whose warnings the command leaves out (errors still show): transformers imports torchao with every
model, and torchao notes each CUDA kernel library that does not load on this machine (its optimizers, the ones
oomb uses, need none), and torch notes a deprecated registration of torchao's."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``oomb`` command. Returns 0; exits with status 2 on bad input, 130 on an interrupt, 1 where
    the reader of stdout has gone (``oomb data | head -1``) -- quietly, as Python's note on SIGPIPE does."""
    import logging

    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    signals = _StartupSignals()
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            code = _main(argv, signals)
        sys.stdout.flush()  # here, where a closed reader is caught, not at exit
        return code
    except BrokenPipeError:
        # The reader of stdout is gone (oomb data | head -1): quietly, as the Python docs' note on SIGPIPE does.
        # stdout goes to devnull, so that the flush at exit meets no closed pipe either.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:  # at any moment, the imports of torch and transformers included
        print("oomb: interrupted", file=sys.stderr)
        return 130
    finally:
        signals.restore()


def _keys_from_file(command: str, argv: Sequence[str], file_keys: set[str]) -> set[str]:
    """The ``section.key`` settings whose value comes from the --config file: its keys, less those a flag given
    overrides."""
    from ..config.flags import command_fields

    given = vars(_given_parser().parse_args(argv))
    overridden = {f"{ff.section}.{ff.name}" for ff in command_fields(command) if ff.dest in given}
    if given.get("sparse") is False:  # --no-sparse: the file's engine.sparse section is not read
        overridden |= {k for k in file_keys if k.startswith("engine.sparse.")}
    return set(file_keys) - overridden


def _main(argv: Sequence[str] | None, signals: _StartupSignals) -> int:
    argv = [str(a) for a in (argv if argv is not None else sys.argv[1:])]
    parser = _build_parser()
    parsed = parser.parse_args(argv)
    command = parsed.command
    if command == "train":  # before the heavy imports: a signal during them is never lost
        signals.install()
    try:
        job, file_keys = _job_config(command, argv, parsed.config)
        if parsed.print_config:
            from ..config.io import dump_yaml

            sys.stdout.write(dump_yaml(job, command))
            return 0
        args = _namespace(command, job)
        args._argv = argv
        args._config_file = parsed.config
        args._config_keys = _keys_from_file(command, argv, file_keys)
        if command == "train":
            args._signals = signals
            return _train(args)
        if command == "plan":
            return _plan(args)
        if command == "grad-error":
            return _grad_error(args)
        if command == "eval":
            return _eval(args)
        if command == "bench":
            return _bench(args)
        if command == "data":
            return _data(args)
        if command == "merge":
            from .merge import _merge

            return _merge(args)
    except UsageError as exc:
        _fail(f"{exc.problem}; {exc.fix}", 1 if isinstance(exc, _RunError) else 2)
    except PermissionError as exc:  # a file or folder of the user's that this user may not read (or write)
        where = f" {exc.filename}" if exc.filename else ""
        _fail(f"permission denied:{where} ({exc.strerror or exc}); give this user access to it (chmod, chown) or pass "
              "another path", 2)
    except Exception as exc:  # an allocation the command did not expect to fail (the CPU allocator's error), or a
        # write of its output (a merged model, --json, --heatmap, --make-output rows) that a full disk stopped
        refusal = _allocation_refusal(exc) if isinstance(exc, RuntimeError) else None
        if refusal is not None:
            _fail(f"{refusal.problem}; {refusal.fix}", 2)
        full = _out_of_space(exc)
        if full is None:
            raise
        _fail(f"{full}; free space on that disk, or pass an output path on another disk, and run the command again", 2)
    parser.error(f"unknown command {command!r}")  # pragma: no cover - argparse rejects it first
