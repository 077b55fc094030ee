"""``python -m kvtier`` runs the ``kvtier`` command."""

import sys

from kvtier.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
