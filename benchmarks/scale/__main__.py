"""`python -m benchmarks.scale [flags]`: many servers and placement (run.py)."""

import sys

from benchmarks.scale.run import main

if __name__ == "__main__":
    sys.exit(main())
