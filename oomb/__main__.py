"""``python -m oomb`` runs the ``oomb`` command."""

import sys

from .cli import main

sys.exit(main())
