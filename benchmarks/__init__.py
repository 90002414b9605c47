"""Benchmarks, run as modules: `python -m benchmarks.<name> [--out FILE]`, each printing a JSON report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(report: dict[str, Any], out: str | Path | None) -> None:
    """Print the JSON report, and write it to `out` when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
