"""``python -m oomb`` runs the ``oomb`` command."""

import sys

try:
    from .cli import main
except KeyboardInterrupt:  # a Ctrl-C while the command is imported: one line, as main() words it (no traceback)
    print("oomb: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
