"""The live gateway benchmark's smoke runs, one a part, small: oversized bodies are refused with a 413 in each API's
format, every session of the tool-set run is served and finished, and every streamed request's first token comes
before its end; each report holds what its targets are judged on."""

from __future__ import annotations

import json

import pytest

from benchmarks.agents.gateway_live import main


def run(tmp_path, *argv: str) -> dict:
    out = tmp_path / "live.json"
    main([*argv, "--out", str(out)])
    report = json.loads(out.read_text())
    assert isinstance(report["meets_targets"], bool) and report["machine"]["cpus"] >= 1
    return report


@pytest.mark.slow
def test_an_oversized_body_is_refused_with_a_413_in_each_apis_format(tmp_path):
    body = run(tmp_path, "--parts", "body", "--body-mib", "3", "--limit-mib", "1", "--tries", "2")["body"]
    assert body["statuses"] == {"413": 2 * 2 * 2} and body["in_api_format"], body
    assert set(body["ms_to_refusal"]) == {
        f"{f}:{api}" for f in ("content_length", "chunked") for api in ("chat", "messages")
    }
    assert all(t["p50"] > 0 and t["max"] >= t["p50"] for t in body["ms_to_refusal"].values())
    assert body["refused"]["bad_requests:413"] == 8
    assert body["peak_rss_mib"] >= body["rss_before_mib"] > 0 and isinstance(body["meets_targets"], bool)


@pytest.mark.slow
def test_sessions_with_tool_sets_of_their_own_are_served_and_finished(tmp_path):
    tools = run(tmp_path, "--parts", "tools", "--sessions", "30", "--batch", "10", "--tools-per-set", "2")["tools"]
    assert tools["failures"] == 0 and tools["statuses"] == {"completed": 30} and tools["sessions_open"] == 0, tools
    assert [s["sessions"] for s in tools["rss_by_sessions"]] == [0, 30]
    assert tools["cached_tool_sets"] == 30 <= tools["max_tool_sets"]  # an encoder for each set, none past the bound
    assert len(tools["rss_growth_mib_per_1000"]) == 1 and all(n > 0 for n in tools["objects_grown"].values())


@pytest.mark.slow
def test_every_streamed_reply_sends_its_first_token_before_its_end(tmp_path):
    argv = ["--stream-requests", "4", "--concurrency", "2", "--tokens", "24", "--decode-ms", "1"]
    stream = run(tmp_path, "--parts", "stream", *argv)["stream"]
    for api in ("chat", "messages"):
        served = stream[api]
        assert served["statuses"] == {"200": 4} and served["turns"] == {"completed": 4} and not served["no_token"]
        # more text events than the one the end sends (the rest of the text): the first came before the end
        assert served["text_events_per_request"]["min"] >= 2, served
        assert served["first_token_delay_ms"]["p50"] > 0 and served["server_to_listener_ms"]["p50"] > 0
