"""`python -m benchmarks.faults [flags]`: the fault-injection suite (suite.py)."""

import sys

from benchmarks.faults.suite import main

if __name__ == "__main__":
    sys.exit(main())
