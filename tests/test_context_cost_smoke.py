"""benchmarks/scale/context_cost.py runs the whole engine on a small size, with and without images: every trajectory
runs its turns against the in-process double, and the report has a figure for each context and image count."""

from __future__ import annotations

import json

from benchmarks.scale.context_cost import main


def test_the_context_cost_benchmark_reports_each_context_and_image_count(tmp_path):
    out = tmp_path / "context_cost.json"
    args = ["--contexts", "64", "256", "--images", "0", "1", "--trajectories", "2", "--turns", "3", "--repeats", "1"]
    assert main([*args, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(row["images"], row["context"]) for row in rows] == [(0, 64), (0, 256), (1, 64), (1, 256)]
    for row in rows:
        assert row["context_tokens"] >= row["context"] and row["cpu_ms_per_turn"] > 0, row
    # an image's tokens are in the context, and its payload in the body
    assert (
        rows[2]["context_tokens"] > rows[0]["context_tokens"]
        and rows[2]["request_bytes"] > 10 * rows[0]["request_bytes"]
    )
