"""Benchmarks, grouped by purpose into packages, each run by its entry point (its `__main__.py`; `--help` gives the
flags). Each prints a JSON report (`--out` writes it too) or writes a report folder; docs/benchmarks.md has every
command and what it measures.

    python -m benchmarks.longtail      slime-style rollout against Turnstile on a simulated SGLang server; that server
                                       (longtail/simserver.py) serves the other benchmarks that need one too
    python -m benchmarks.faults        the fault-injection suite; benchmarks.faults.hung_env: a hung env under
                                       `turnstile run`
    python -m benchmarks.scale         many servers and placement; benchmarks.scale.shards (rollout shards) and
                                       benchmarks.scale.context_cost (a turn's cost against its history)
    python -m benchmarks.agents        agent programs through the session gateway; benchmarks.agents.gateway and
                                       benchmarks.agents.gateway_live: the gateway's cost
    python -m benchmarks.micro [NAME]  one cost at a time (without NAME: the list of them)
"""

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
