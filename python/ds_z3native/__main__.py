import sys

from .cli import main

# Guarded: the demo's and self-test's ranks are spawned, and spawn re-imports the main module.
if __name__ == "__main__":
    sys.exit(main())
