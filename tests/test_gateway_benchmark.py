"""The gateway benchmark's smoke run: both runs (paced and lockstep) serve every request of every session through
the gateway from a client process, one chain per session, and the report holds what its targets are judged on."""

from __future__ import annotations

import json

from benchmarks.agents.gateway import main


def test_the_gateway_benchmark_serves_every_request_paced_and_in_lockstep(tmp_path, capsys):
    out = tmp_path / "gateway.json"
    main(["--sessions", "24", "--requests", "3", "--tool-median-s", "0.01", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["sessions"] == 24 and report["engine_cpu_ms_per_turn"] > 0
    for run in ("paced", "lockstep"):
        served = report[run]
        assert served["requests"] == 24 * 3 and served["failures"] == 0 and served["forks"] == 0, served
        assert served["gateway_cpu_ms_per_request"] > 0 and served["loop_lag_ms"]["samples"] > 0
    assert report["paced"]["tool_median_s"] == 0.01 and report["lockstep"]["tool_median_s"] == 0.0
    assert set(report["targets"]) == {"cpu_ms_per_request_beyond_the_turn (lockstep)", "loop_lag_p99_ms (paced)"}
    assert isinstance(report["meets_targets"], bool)
