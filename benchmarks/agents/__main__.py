"""`python -m benchmarks.agents [flags]`: the agent benchmark (run.py)."""

import sys

from benchmarks.agents.run import main

if __name__ == "__main__":
    sys.exit(main())
