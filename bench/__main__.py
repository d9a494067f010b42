"""``python -m bench <name|all> [--smoke] [--output-dir DIR]``: see ``bench.suite``."""

import sys

from bench.suite import main

if __name__ == "__main__":
    sys.exit(main())
