"""SGLangBackend behind a real sglang-router (tests/router.py) in front of two SGLangDoubles: generation through
the router, session affinity by routing key, control calls straight to each worker, and the CLI.

The router forwards /generate without the client's User-Agent; the backend's own calls reach the doubles with
httpx2's, so `direct` tells what the backend sent a worker from what the router forwarded or polled itself.
"""

from __future__ import annotations

import json
import logging

import anyio
import httpx2
import pytest

from engine.backends.base import SamplingParams
from engine.backends.sglang import SGLangBackend
from engine.cli import main
from engine.errors import BackendError, ErrorClass
from tests.net import free_port
from tests.router import SGLangRouter
from tests.sglang_double import Generate, Recorded, SGLangDouble

PARAMS = SamplingParams(max_new_tokens=4)


def direct(double: SGLangDouble, path: str) -> list[Recorded]:
    """The requests to `path` the backend sent this double itself (not through the router)."""
    return [r for r in double.requests_to(path) if r.headers.get("user-agent", "").startswith("python-httpx")]


def forwarded(double: SGLangDouble) -> list[Recorded]:
    """The /generate requests the router forwarded to this double."""
    mine = direct(double, "/generate")
    return [r for r in double.requests_to("/generate") if r not in mine]


def sessions_of(double: SGLangDouble) -> set[str]:
    return {r.headers["x-smg-routing-key"] for r in forwarded(double) if "x-smg-routing-key" in r.headers}


async def wait_held(double: SGLangDouble, count: int) -> None:
    assert await anyio.to_thread.run_sync(double.wait_held, count), f"{count} requests were never held"


async def session_per_double(backend: SGLangBackend, doubles: tuple[SGLangDouble, ...]) -> list[str]:
    """For each double, a session the router sends there (its policy maps a key to a worker for good)."""
    found: dict[int, str] = {}
    for n in range(64):
        key = f"probe-{n}"
        await backend.generate([1], PARAMS, session_id=key)
        [index] = [i for i, d in enumerate(doubles) if key in sessions_of(d)]
        found.setdefault(index, key)
        if len(found) == len(doubles):
            return [found[i] for i in range(len(doubles))]
    raise AssertionError(f"64 sessions all went to the doubles {sorted(found)}")


@pytest.fixture
def doubles():
    with SGLangDouble() as a, SGLangDouble() as b:
        yield a, b


@pytest.fixture
def router(doubles):
    with SGLangRouter([d.url for d in doubles]) as router:
        yield router


@pytest.fixture
async def backend(router):
    async with SGLangBackend(router.url, timeout=30) as client:
        yield client


# -- finding the workers, generating through the router --------------------------------------------


@pytest.mark.anyio
async def test_the_backend_finds_both_workers_behind_the_router(doubles, router, backend):
    assert backend.is_router is True
    assert await backend.health() is True
    assert all(len(direct(d, "/health")) == 1 for d in doubles)  # each worker asked itself


@pytest.mark.anyio
async def test_generate_goes_through_the_router(doubles, backend):
    doubles[0].script(Generate(token_ids=[5, 6]))
    doubles[1].script(Generate(token_ids=[5, 6]))
    result = await backend.generate([1, 2], PARAMS, rid="traj-1")
    assert (result.token_ids, result.finish_reason) == ([5, 6], "stop")
    [request] = [r for d in doubles for r in d.requests_to("/generate")]
    assert request in forwarded(doubles[0]) + forwarded(doubles[1])
    assert request.body["rid"] == f"{backend.rid_prefix}0-traj-1"


@pytest.mark.anyio
@pytest.mark.parametrize("policy", ["consistent_hashing", "manual"])
async def test_a_sessions_turns_reach_one_worker_and_sessions_spread(doubles, policy):
    sessions = [f"traj-{i}" for i in range(16)]
    with SGLangRouter([d.url for d in doubles], policy=policy) as router:
        async with SGLangBackend(router.url, timeout=30) as backend:
            for turn in range(3):
                for session in sessions:
                    await backend.generate([turn], PARAMS, session_id=session)
    on = [sessions_of(d) for d in doubles]
    assert on[0] | on[1] == set(sessions) and not on[0] & on[1]  # each session on one double only
    assert on[0] and on[1]  # and the sessions spread over both
    assert all(len(forwarded(d)) == 3 * len(on[i]) for i, d in enumerate(doubles))


# -- control calls straight to each worker ----------------------------------------------------------


@pytest.mark.anyio
async def test_abort_reaches_both_workers_and_leaves_other_clients_requests(doubles, backend):
    a, b = doubles
    session_a, session_b = await session_per_double(backend, doubles)
    a.script(Generate(hold=True), Generate(token_ids=[3], hold=True))
    b.script(Generate(token_ids=[4], hold=True))
    body = {"input_ids": [9], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True, "rid": "other-7"}
    results, done = {}, {"traj-a": anyio.Event(), "traj-b": anyio.Event()}

    async def foreign() -> None:  # another client of the same worker, not through this backend
        async with httpx2.AsyncClient(trust_env=False) as client:
            results["other"] = (await client.post(f"{a.url}/generate", json=body)).json()

    async def ours(rid: str, session: str) -> None:
        results[rid] = await backend.generate([1], PARAMS, rid=rid, session_id=session)
        done[rid].set()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(foreign)
            await wait_held(a, 1)
            tg.start_soon(ours, "traj-a", session_a)
            tg.start_soon(ours, "traj-b", session_b)
            await wait_held(a, 2)
            await wait_held(b, 1)
            [sent_a], [sent_b] = ([r for r in d.held_rids if r.startswith(backend.rid_prefix)] for d in doubles)
            assert sent_a.endswith("-traj-a") and sent_b.endswith("-traj-b")

            await backend.abort("traj-a")  # that one only
            await done["traj-a"].wait()
            assert (a.held_rids, b.num_held) == (["other-7"], 1)

            await backend.abort()  # all of this backend's: traj-b on the other worker
            await done["traj-b"].wait()
            assert (a.held_rids, b.num_held) == (["other-7"], 0)  # the other client's request goes on
            a.release_all()
    assert (results["traj-a"].finish_reason, results["traj-a"].token_ids) == ("abort", [3])
    assert (results["traj-b"].finish_reason, results["traj-b"].token_ids) == ("abort", [4])
    for double in doubles:  # each worker was asked, each time, with this backend's request ids only
        assert sorted(r.body["rid"] for r in direct(double, "/abort_request")) == [sent_a, sent_b]


@pytest.mark.anyio
async def test_weight_versions_come_from_the_workers(doubles, backend, caplog):
    a, b = doubles
    a.weight_version = b.weight_version = "step-3"
    assert await backend.weight_version() == "step-3"
    assert all(len(direct(d, "/model_info")) == 1 for d in doubles)

    b.weight_version = "step-4"
    assert await backend.weight_version() in {"step-3", "step-4"}
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{a.url}: 'step-3'" in warning and f"{b.url}: 'step-4'" in warning


@pytest.mark.anyio
async def test_weight_updates_pause_and_resume_reach_every_worker(doubles, backend):
    reply = await backend.update_weights_from_disk("/ckpt/iter_0000010", weight_version="10")
    assert reply["success"] is True
    assert [d.weight_version for d in doubles] == ["10", "10"]
    await backend.pause()
    assert [d.paused_mode for d in doubles] == ["in_place", "in_place"]
    await backend.resume()
    assert [d.paused_mode for d in doubles] == [None, None]
    for double in doubles:
        assert [r.body for r in direct(double, "/update_weights_from_disk")] == [
            {"model_path": "/ckpt/iter_0000010", "weight_version": "10"}
        ]
        assert len(direct(double, "/pause_generation")) == len(direct(double, "/continue_generation")) == 1


@pytest.mark.anyio
async def test_a_worker_added_later_is_reached(doubles, router, backend):
    with SGLangDouble() as c:
        router.add_worker(c.url)
        await backend.pause()
        assert [d.paused_mode for d in (*doubles, c)] == ["in_place"] * 3


@pytest.mark.anyio
async def test_a_worker_that_is_down_is_logged_and_passed_over(doubles, router, backend, caplog):
    with SGLangDouble() as c:
        router.add_worker(c.url)
    await backend.pause()  # c is still listed, but gone
    assert [d.paused_mode for d in doubles] == ["in_place", "in_place"]
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"SGLang server at {c.url} (a worker of sglang-router at {router.url}) is unreachable" in warning
    with pytest.raises(BackendError) as info:  # a weight update must reach every worker
        await backend.update_weights_from_disk("/ckpt/2")
    assert "failed on 1 of 3" in info.value.message and c.url in info.value.message


# -- a single server, a router without workers -----------------------------------------------------


@pytest.mark.anyio
async def test_a_single_sglang_url_still_works(doubles):
    a, _ = doubles
    async with SGLangBackend(a.url) as backend:
        assert backend.is_router is False
        assert (await backend.generate([1, 2], PARAMS, session_id="s")).token_ids == [1, 2]
        assert await backend.weight_version() == "default"
        await backend.pause()
    assert [r.path for r in a.requests] == ["/workers", "/generate", "/model_info", "/pause_generation"]
    assert a.requests_to("/generate")[0].headers["x-smg-routing-key"] == "s"


@pytest.mark.anyio
async def test_a_router_with_no_reachable_workers_is_one_clear_error():
    with SGLangRouter([f"http://127.0.0.1:{free_port()}"], wait_for_workers=False) as router:
        backend = SGLangBackend(router.url)
        with pytest.raises(BackendError) as info:
            await backend.__aenter__()
        lazily = SGLangBackend(router.url)
        try:
            assert await lazily.health() is False
            with pytest.raises(BackendError) as later:
                await lazily.weight_version()
        finally:
            await lazily.aclose()
    assert info.value.error_class is ErrorClass.CONNECTION
    assert info.value.message.startswith(f"sglang-router at {router.url} lists no workers (GET /workers: ")
    assert "no worker has registered with it yet, or none is reachable from it" in info.value.message
    assert later.value.message == info.value.message


# -- turnstile run ----------------------------------------------------------------------------------


def test_turnstile_run_through_the_router(tmp_path, doubles, router):
    for double in doubles:
        double.weight_version = "step-7"
    out = tmp_path / "router.jsonl"
    argv = ["run", "--backend", "sglang", "--url", router.url, "--tokenizer", "qwen2.5", "--num-prompts", "2"]
    argv += ["--max-turns", "2"]
    assert main([*argv, "--max-new-tokens", "4", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    assert {v for r in records for v in r["weight_versions"]} == {"step-7"}
    num_turns = sum(len(r["turns"]) for r in records)
    assert sum(len(forwarded(d)) for d in doubles) == num_turns  # every turn went through the router
    assert all(direct(d, "/model_info") for d in doubles)  # the weight version was read from each worker


@pytest.mark.parametrize("workers", ["stopped", "never up"])
def test_turnstile_run_fails_in_one_line_when_the_routers_workers_are_down(tmp_path, capsys, workers):
    if workers == "stopped":  # registered, then gone: the router still lists them
        with SGLangDouble() as a, SGLangDouble() as b:
            router = SGLangRouter([a.url, b.url]).start()
        expected = f"turnstile: the sglang backend at {router.url} is not healthy"
    else:
        router = SGLangRouter([f"http://127.0.0.1:{free_port()}"], wait_for_workers=False).start()
        expected = f"turnstile: the sglang backend at {router.url} is not healthy: sglang-router at {router.url}"
    try:
        argv = ["run", "--backend", "sglang", "--url", router.url, "--tokenizer", "qwen2.5", "--num-prompts", "1"]
        code = main([*argv, "--out", str(tmp_path / "x.jsonl")])
    finally:
        router.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith(expected), err


# -- the bridge behind slime's router: its default policy does not pin a trajectory --------------------------


async def turns_through(backend, sessions: list[str], turns: int) -> None:
    for turn in range(turns):
        for session in sessions:  # a conversation's prompt grows turn by turn, as a trajectory's does
            await backend.generate(list(range(1, 8 * (turn + 1))), PARAMS, session_id=session)


def sessions_sent_directly(double: SGLangDouble) -> list[str]:
    return [r.headers["x-smg-routing-key"] for r in direct(double, "/generate")]


@pytest.mark.anyio
async def test_under_the_routers_default_policy_the_bridge_keeps_each_trajectory_on_one_worker(doubles, caplog):
    from bridge.service import routed_backend

    sessions = [f"traj-{i}" for i in range(16)]
    router = SGLangRouter([d.url for d in doubles], policy="cache_aware")
    with router, caplog.at_level(logging.WARNING, logger="bridge.service"):
        async with routed_backend(router.url, router_policy=None) as backend:  # slime's default: cache_aware
            await turns_through(backend, sessions, turns=3)
    assert "generation goes to the 2 workers of sglang-router" in caplog.text and "cache_aware" in caplog.text
    assert not forwarded(doubles[0]) and not forwarded(doubles[1])  # straight to the workers, not via the router
    on = [set(sessions_sent_directly(d)) for d in doubles]
    assert on[0] | on[1] == set(sessions) and not on[0] & on[1]  # every turn of a trajectory on one worker
    assert on[0] and on[1]  # and the trajectories spread over both
    assert all(len(sessions_sent_directly(d)) == 3 * len(on[i]) for i, d in enumerate(doubles))


@pytest.mark.anyio
@pytest.mark.parametrize(("policy", "routing"), [("manual", "auto"), ("cache_aware", "router")])
async def test_a_pinning_policy_or_session_routing_router_keeps_generation_on_the_router(doubles, policy, routing):
    from bridge.service import routed_backend

    with SGLangRouter([d.url for d in doubles], policy=policy) as router:
        async with routed_backend(router.url, router_policy=policy, routing=routing) as backend:
            assert isinstance(backend, SGLangBackend) and backend.is_router
            await turns_through(backend, ["traj-0", "traj-1"], turns=2)
    assert len(forwarded(doubles[0]) + forwarded(doubles[1])) == 4
    assert not direct(doubles[0], "/generate") and not direct(doubles[1], "/generate")


def test_the_bridge_reads_slimes_router_policy_and_its_own_session_routing():
    from types import SimpleNamespace

    from bridge.settings import settings_from_args

    args = SimpleNamespace(sglang_router_ip="127.0.0.1", sglang_router_port=1, router_policy="manual")
    assert settings_from_args(args).router_policy == "manual" and settings_from_args(args).session_routing == "auto"
    args.turnstile = {"session_routing": "workers"}
    assert settings_from_args(args).session_routing == "workers"
    args.turnstile = {"router_policy": "random"}
    with pytest.raises(ValueError, match="router_policy"):  # slime's flag decides it
        settings_from_args(args)
