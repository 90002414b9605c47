"""The fault suite against a real SGLang server on CPU (`python -m benchmarks.faults --sglang`), at its smoke size: the
fault-free baseline, env exceptions, and HTTP 5xx injected by the fault proxy into the real server's replies.
No prompt is lost, the engine neither crashed nor hung, and each fault is counted under its class. Also the
proxy on its own in front of the real server: replies pass through unchanged, or come back as the errors the
client classifies (tests/test_faults_smoke.py checks it without a server).

The two fault cases run at higher rates than the suite's (20% of env steps, 25% of /generate requests), so that
a smoke-sized run, a few dozen calls, draws them. The proxy draws in the order requests arrive, from a generator
seeded with the suite's seed, and how many requests a run makes depends on its trajectories' turns (under 26 in
one run, over 43 in another). So the suite runs with seed 1, whose first draw is a fault: the run's first
/generate is answered 503 however many follow (seed 0's first 25 draws are none). The env is declared replay
safe, so a failed step is retried: an env that is not ends its trajectory at its first fault, and at 30% a step of
4 trajectories then had more than half of them FAILED often enough that both steps were refused and nothing
trained.

One SGLang server is started for the module (about 25 s on an idle 2-core machine, far longer on a busy one);
without the SGLang venv the tests skip, saying why (fail under TURNSTILE_REQUIRE_SGLANG=1).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import replace

import anyio
import pytest

from benchmarks.faults.cases import CASES
from benchmarks.faults.proxy import FaultProxy, ProxyFaults
from benchmarks.faults.suite import SGLANG_SIZES, run_suite, write_outputs
from benchmarks.longtail.model import IM_END, IM_START
from engine.backends.base import SamplingParams
from engine.backends.sglang import SGLangBackend
from engine.envs.faults import FaultSpec
from engine.errors import BackendError, ErrorClass

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

SIZE = SGLANG_SIZES["smoke"]
SEED = 1  # random.Random(1).random() is 0.134: the server case's first /generate is a fault
BY_NAME = {case.name: case for case in CASES}
ENV_CASE = replace(
    BY_NAME["env_exception_10pct_replay_safe"], name="env_exception_20pct_replay_safe",
    what="20% of env steps raise; the env declared replay safe", env=FaultSpec(exception=0.20, replay_safe=True),
)  # fmt: skip
SERVER_CASE = replace(
    BY_NAME["server_5xx"], name="server_5xx_25pct", what="25% of /generate requests answered HTTP 503 by the proxy",
    server_faults={"error_rate": 0.25},
)  # fmt: skip
PROMPT = [IM_START, 872, 198, 1000, 1001, 1002, IM_END, 198, IM_START, 77091, 198]
PARAMS = SamplingParams(max_new_tokens=4, stop_token_ids=(IM_END,))


@pytest.fixture(scope="module")
def sglang_server(tmp_path_factory):
    from benchmarks.faults.servers import ProcessUnavailable
    from benchmarks.faults.sglang import SGLangProcess, unavailable

    if (reason := unavailable()) is not None:
        print(reason)
        if os.environ.get("TURNSTILE_REQUIRE_SGLANG") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    server = SGLangProcess(tmp_path_factory.mktemp("sglang") / "server.log")  # the suite's own kind of server
    try:
        server.start()
    except ProcessUnavailable as error:
        pytest.fail(str(error))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def report(sglang_server, tmp_path_factory):
    from benchmarks.faults.sglang import SGLangServers

    out = tmp_path_factory.mktemp("faults-sglang")
    servers = SGLangServers(url=sglang_server.url)
    done = anyio.run(lambda: run_suite(SIZE, [ENV_CASE, SERVER_CASE], seed=SEED, workdir=out, servers=servers))
    write_outputs(done, out)
    return json.loads((out / "report.json").read_text()), out


def test_the_report_is_of_the_real_server_and_says_what_it_covers(report):
    report, out = report
    assert report["server"] == "sglang"
    assert list(report["faults"]) == ["none", ENV_CASE.name, SERVER_CASE.name]
    assert report["sglang"]["run"] is True and "faults/proxy.py" in report["sglang"]["covers"]
    table = (out / "report.md").read_text()
    assert "sglang server" in table and "Against real SGLang" in table
    assert (out / "faults.png").stat().st_size > 0


@pytest.mark.parametrize("name", ["none", ENV_CASE.name, SERVER_CASE.name])
def test_no_fault_loses_a_prompt_or_breaks_the_engine_against_real_sglang(report, name):
    entry = report[0]["faults"][name]
    assert "suite_error" not in entry and "skipped" not in entry, entry
    prompts = entry["prompts"]
    assert entry["engine_failure"] is None, entry["engine_failure"]
    assert prompts["lost"] == 0 and prompts["returned_twice"] == 0, prompts
    assert prompts["taken"] == prompts["returned"] + prompts["held"] + prompts["dropped"]
    assert entry["steps"]["completed"] == SIZE.num_steps
    assert prompts["returned"] == SIZE.num_steps * SIZE.target_groups
    assert sum(entry["trajectories"]["by_status"].values()) == entry["trajectories"]["returned"]
    assert entry["throughput"]["trained_tokens"] > 0


def test_env_exceptions_are_counted_under_their_class(report):
    entry = report[0]["faults"][ENV_CASE.name]
    raised = entry["injected"]["env"].get("exception", 0)
    assert raised > 0, entry["injected"]
    spent, failed = entry["retries"]["spent_by_class"], entry["trajectories"]["failed_by_error_class"]
    assert spent.get("env_exception", 0) > 0, (spent, failed)  # replay safe: a failed step is retried
    assert set(failed) <= {"env_exception"}, failed  # nothing else went wrong


def test_server_errors_from_the_proxy_are_counted_under_their_class(report):
    assert random.Random(SEED).random() < SERVER_CASE.server_faults["error_rate"]  # the proxy's first draw
    entry = report[0]["faults"][SERVER_CASE.name]
    injected = entry["injected"]["server"]
    assert injected["server_error"] > 0 and injected["malformed"] == 0, injected
    spent, failed = entry["retries"]["spent_by_class"], entry["trajectories"]["failed_by_error_class"]
    assert spent.get("server", 0) > 0, spent
    assert set(failed) <= {"server"}, failed
    assert report[0]["faults"]["none"]["injected"]["server"] == {"server_error": 0, "malformed": 0}


@pytest.mark.anyio
async def test_the_proxy_passes_the_real_server_through_or_corrupts_it_into_classified_errors(sglang_server):
    async with FaultProxy(sglang_server.url) as proxy, SGLangBackend(proxy.url, timeout=120) as backend:
        assert backend.is_router is False  # GET /workers went through: the server's 404
        reply = await backend.generate(PROMPT, PARAMS)
        assert len(reply.token_ids) == len(reply.logprobs) > 0 and reply.finish_reason in ("stop", "length")
        assert proxy.forwarded["POST /generate"] == 1

        proxy.set_faults(ProxyFaults(error_rate=1.0))
        with pytest.raises(BackendError) as raised:
            await backend.generate(PROMPT, PARAMS)
        assert raised.value.error_class is ErrorClass.SERVER and "HTTP 503" in raised.value.message
        assert proxy.forwarded["POST /generate"] == 1  # answered without reaching the server

        proxy.set_faults(ProxyFaults(malformed_rate=1.0, seed=3))
        for _ in range(6):  # each kind of corrupted reply is one the client refuses
            with pytest.raises(BackendError) as raised:
                await backend.generate(PROMPT, PARAMS)
            assert raised.value.error_class is ErrorClass.MALFORMED
        assert proxy.forwarded["POST /generate"] == 7  # generated by the server, then corrupted
        assert dict(proxy.injected) == {"server_error": 1, "malformed": 6}
        assert await backend.weight_version() is not None  # control calls pass through untouched
