"""``python -m bench <name|all> [--smoke] [--output-dir DIR]``: see ``bench.core.cli``."""

import sys

from bench.core.cli import main

if __name__ == "__main__":
    sys.exit(main())
