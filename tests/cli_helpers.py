"""Test helper: run ``oomb`` in-process, as the command line would, and return its exit status.

The tests of the command line (tests/cli and the model and training tests that drive ``oomb train``) import it by
name, as they import configs.py beside it.
"""

from __future__ import annotations

from oomb.cli import main


def run_cli(argv) -> int | str | None:
    """Run ``oomb.cli.main(argv)`` in-process (each argument passed as ``str``); return the exit status: main's
    return value, or the code of the SystemExit it raised."""
    try:
        return main([str(a) for a in argv])
    except SystemExit as exc:
        return exc.code
