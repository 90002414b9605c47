"""`python -m benchmarks.longtail [flags]`: the long-tail benchmark (run.py)."""

import sys

from benchmarks.longtail.run import main

if __name__ == "__main__":
    sys.exit(main())
