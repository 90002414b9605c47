"""The fault-injection suite (benchmarks/faults/) end to end at its smallest size: every fault injected, no
prompt lost, the engine neither crashed nor hung, and the report, table and figure written. Also the simulated
server's own fault injection, and its restart on the same port; the fault proxy of the --sglang variant where no
server answers, and its bad settings; the suite's bad flags. (tests/test_faults_sglang.py runs the suite against a
real SGLang server.)"""

from __future__ import annotations

import json

import httpx2
import pytest

from benchmarks.faults.cases import CASES
from benchmarks.faults.proxy import FaultProxy, ProxyFaults
from benchmarks.faults.servers import SimProcess, free_port
from benchmarks.faults.suite import SIZES, main
from benchmarks.longtail.model import IM_END, IM_START
from benchmarks.longtail.simserver import SimConfig
from engine.backends.base import SamplingParams
from engine.backends.sglang import SGLangBackend
from engine.errors import BackendError, ErrorClass

SIZE = "smoke"
ENGINE_CASES = [case.name for case in CASES if not case.ray]
BY_NAME = {case.name: case for case in CASES}
# rates of 0.5-2%: in so few calls they may draw nothing (which trajectories a step ends with, and so how many
# env calls a case makes, depends on timing)
LOW_RATE = {"env_exception_1pct", "env_hang", "env_hang_replay_safe", "env_malformed", "env_malformed_content", "all"}


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults")
    assert main(["--out", str(out), "--size", SIZE, "--faults", *ENGINE_CASES]) == 0
    return json.loads((out / "report.json").read_text()), out


def ray_case(tmp_path_factory, name: str) -> dict:
    """One of the Ray cases, run alone: its entry."""
    pytest.importorskip("ray", reason="Ray is part of the dev extra; install it with `pip install -e .[dev]`")
    out = tmp_path_factory.mktemp(name)
    assert main(["--out", str(out), "--size", SIZE, "--faults", name]) == 0
    return entry_of(json.loads((out / "report.json").read_text()), name)


@pytest.fixture(scope="module")
def ray_suite(tmp_path_factory):
    return ray_case(tmp_path_factory, "ray_actor_restart")


@pytest.fixture(scope="module")
def shard_suite(tmp_path_factory):
    return ray_case(tmp_path_factory, "ray_shard_killed")


def entry_of(report: dict, name: str) -> dict:
    """A case's entry; a case that cannot run here (no sglang-router, no Ray) skips, saying why."""
    entry = report["faults"][name]
    if "skipped" in entry:
        print(f"{name} skipped: {entry['skipped']}")
        pytest.skip(entry["skipped"])
    assert "suite_error" not in entry, entry["suite_error"]
    return entry


@pytest.mark.anyio
async def test_the_simulated_server_injects_server_errors_and_malformed_replies_and_restarts_on_its_port():
    prompt = [IM_START, 872, 198, 1000, IM_END, 198, IM_START, 77091, 198]
    params = SamplingParams(max_new_tokens=32, stop_token_ids=(IM_END,))
    with SimProcess(SimConfig(max_running=4, median_tokens=8.0, sigma=0.0)) as server:
        async with SGLangBackend(server.url, timeout=30) as backend, httpx2.AsyncClient(base_url=server.url) as http:
            (await http.post("/sim/faults", json={"error_rate": 1.0})).raise_for_status()
            with pytest.raises(BackendError) as raised:
                await backend.generate(prompt, params)
            assert raised.value.error_class is ErrorClass.SERVER and "HTTP 503" in raised.value.message
            (await http.post("/sim/faults", json={"error_rate": 0.0, "malformed_rate": 1.0})).raise_for_status()
            for _ in range(6):  # each kind of malformed body is one the client refuses
                with pytest.raises(BackendError) as raised:
                    await backend.generate(prompt, params)
                assert raised.value.error_class is ErrorClass.MALFORMED
            (await http.post("/sim/faults", json={"malformed_rate": 0.0})).raise_for_status()
            assert (await backend.generate(prompt, params)).finish_reason == "stop"
            faults = (await http.get("/sim/faults")).json()
            assert faults["injected"] == {"server_error": 1, "malformed": 6}
            assert (await http.get("/stats")).json()["injected"] == faults["injected"]
            assert (await http.post("/sim/faults", json={"bogus": 1})).status_code == 400

            server.kill()
            with pytest.raises(BackendError) as raised:
                await backend.generate(prompt, params)
            assert raised.value.error_class is ErrorClass.CONNECTION
            server.start()  # the same port: the client carries on
            assert (await backend.generate(prompt, params)).finish_reason == "stop"


@pytest.mark.anyio
async def test_the_fault_proxy_drops_the_connection_when_its_server_is_gone():
    prompt = [IM_START, 872, 198, 1000, IM_END, 198, IM_START, 77091, 198]
    async with FaultProxy(f"http://127.0.0.1:{free_port()}") as proxy:  # nothing listens there
        backend = SGLangBackend(proxy.url, timeout=10)
        try:
            with pytest.raises(BackendError) as raised:
                await backend.generate(prompt, SamplingParams(max_new_tokens=4))
        finally:
            await backend.aclose()
    assert raised.value.error_class is ErrorClass.CONNECTION  # as from a dead server, not a proxy's HTTP 502
    assert proxy.dropped == 1 and not proxy.forwarded


def test_bad_fault_proxy_settings_are_one_error_naming_them():
    with pytest.raises(ValueError, match="error_rate must be between 0 and 1, got 1.5"):
        ProxyFaults(error_rate=1.5)
    with pytest.raises(ValueError, match="error_rate \\+ malformed_rate must be at most 1"):
        ProxyFaults(error_rate=0.6, malformed_rate=0.6)
    with pytest.raises(ValueError, match="error_status must be a 5xx status, got 404"):
        ProxyFaults(error_status=404)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sglang", "--size", "large"], "--size large is not sized for the SGLang CPU server; with --sglang choose "
                                          "smoke or small"),
        (["--sglang-url", "http://127.0.0.1:1"], "--sglang-url is read with --sglang only"),
    ],
)  # fmt: skip
def test_a_bad_suite_flag_is_one_error_at_start(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(tmp_path), *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.slow
def test_the_suite_writes_a_report_with_an_entry_per_fault_a_table_and_a_figure(suite):
    report, out = suite
    assert list(report["faults"]) == ENGINE_CASES
    assert report["size"] == SIZE and report["complete"] and report["sglang"]["run"] is False
    assert report["server"] == "simulated" and "--sglang runs every case" in report["sglang"]["why"]
    table = (out / "report.md").read_text()
    assert all(name in table for name in ENGINE_CASES)
    assert (out / "faults.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ENGINE_CASES)
def test_no_fault_loses_a_prompt_or_breaks_the_engine(suite, name):
    entry = entry_of(suite[0], name)
    size = SIZES[SIZE]
    prompts = entry["prompts"]
    assert entry["engine_failure"] is None, entry["engine_failure"]
    assert prompts["lost"] == 0, prompts
    assert prompts["returned_twice"] == 0
    assert prompts["taken"] == prompts["returned"] + prompts["held"] + prompts["dropped"]
    assert entry["steps"]["completed"] == size.num_steps
    assert prompts["returned"] == size.num_steps * size.target_groups
    assert entry["trajectories"]["returned"] == prompts["returned"] * size.n_samples
    assert sum(entry["trajectories"]["by_status"].values()) == entry["trajectories"]["returned"]
    assert entry["throughput"]["trained_tokens"] > 0
    retries = entry["retries"]
    assert retries["most_by_one_trajectory"] <= retries["budget_per_trajectory"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in ENGINE_CASES if n not in ("none", "agents_none")])  # the baselines
def test_each_fault_is_injected_and_shows_in_the_figures(suite, name):
    entry, case = entry_of(suite[0], name), BY_NAME[name]
    injected, actions, spent = entry["injected"], entry["actions"], entry["retries"]["spent_by_class"]
    failed = entry["trajectories"]["by_status"].get("failed", 0)
    required = name not in LOW_RATE  # a low rate may draw nothing in so few calls; kills always happen
    if case.env is not None and required:
        assert sum(injected["env"].values()) > 0, injected
    if case.reward_error_rate:
        raised = injected["reward"]["raised"]
        assert raised > 0 or not required
        assert (spent.get("reward", 0) > 0) == (raised > 0), (raised, spent)  # a reward error is retried
    if case.server_faults:
        server = sum(injected["server"].values()) + sum(injected.get("server_before_restart", {}).values())
        assert server > 0 or not required
        if server:
            assert spent.get("server", 0) + spent.get("malformed", 0) > 0, spent
    if case.kill_envs:
        kills = [a for a in actions if a["action"] == "kill env process"]
        assert len(kills) == case.kill_envs and all(a.get("pid") for a in kills), actions
        assert failed + spent.get("env_exception", 0) > 0
    if case.restart_server:
        assert any(a["action"] == "kill and restart the server" for a in actions)
        assert spent.get("connection", 0) > 0, spent
    if case.kill_worker:
        assert any(a["action"] == "kill one of two servers for good" for a in actions)
    if case.agents is not None:
        assert_agent_faults_shown(entry, case.agents)
    elif required and not case.kill_worker:  # behind a router, the router's own retries may hide a dead worker
        assert failed + sum(spent.values()) > 0, (failed, spent)
    assert entry["throughput"]["relative_to_none"] > 0
    assert entry["steps"]["inflation_p50"] > 0 and entry["steps"]["inflation_mean"] > 0


def assert_agent_faults_shown(entry: dict, faults) -> None:
    """An agent case: its faults were injected, and each shows where it should (the agents' own counts, from their
    process; the gateway's counts; the trajectories' statuses)."""
    agents, gateway = entry["injected"]["agents"], entry["injected"]["gateway"]
    by_class = entry["trajectories"]["failed_by_error_class"]
    assert agents["requests"] > 0 and gateway.get("agent_exits:finished", 0) > 0
    assert set(by_class) <= {"agent"}, by_class  # an agent's fault fails its own session, as an agent error
    if faults.crash:
        assert agents["crashed"] > 0 and gateway["agent_exits:crashed"] >= agents["crashed"], (agents, gateway)
        assert by_class.get("agent", 0) > 0
    if faults.hang:
        assert agents["hung"] > 0, agents
    if faults.malformed:  # each one refused with a 4xx in the API's format (else its agent crashes), counted
        sent = sum(v for k, v in agents.items() if k.startswith("malformed_sent:"))
        assert sent > 0 and agents["malformed_refused"] == sent, agents
        refused = sum(gateway.get(f"bad_requests:{status}", 0) for status in (400, 401, 404))
        assert refused >= sent, gateway
    if faults.disconnect:  # the same request again after leaving its stream: the one reply, no fork
        assert agents["disconnects"] > 0, agents
        assert not any(k.startswith("forks:") for k in gateway), gateway
    if faults.malformed or faults.disconnect:
        assert entry["trajectories"]["by_status"].get("failed", 0) == 0 and "crashed" not in agents, entry


@pytest.mark.slow
def test_a_ray_actor_restart_is_accounted_for(ray_suite):
    entry = ray_suite
    prompts = entry["prompts"]
    assert entry["engine_failure"] is None, entry["engine_failure"]
    [kill] = entry["actions"]
    assert kill["action"].startswith("kill the rollout service's Ray actor")
    assert prompts["lost_at_actor_restart"] == 0  # the caller's handle gave the new actor what the dead one held
    assert prompts["taken"] == prompts["returned"] + prompts["held"] + prompts["lost"]
    assert prompts["returned_twice"] == 0
    assert entry["steps"]["completed"] == SIZES[SIZE].num_steps


@pytest.mark.slow
def test_a_ray_actor_restart_loses_no_prompt(ray_suite):
    [kill] = [a for a in ray_suite["actions"] if a["action"].startswith("kill the rollout service's Ray actor")]
    if not kill["held_when_killed"]:
        pytest.skip("the actor held nothing when it was killed: nothing to lose")
    assert kill["restarts"] == 1
    assert ray_suite["prompts"]["lost"] == 0 and ray_suite["prompts"]["lost_at_actor_restart"] == 0


@pytest.mark.slow
def test_a_shard_killed_mid_step_loses_no_prompt(shard_suite):
    entry = shard_suite
    prompts = entry["prompts"]
    assert entry["engine_failure"] is None, entry["engine_failure"]
    [kill] = entry["actions"]
    assert kill["action"].startswith("kill the rollout shard") and kill["restarts"] == 1
    assert kill["held_when_killed"] > 0  # it died holding groups
    assert prompts["lost"] == 0 and prompts["lost_at_actor_restart"] == 0
    assert prompts["taken"] == prompts["returned"] + prompts["held"]
    assert prompts["returned_twice"] == 0
    assert entry["steps"]["completed"] == SIZES[SIZE].num_steps
