"""BackendPool: least-loaded servers, sessions kept on their server, retries that land elsewhere, aborts routed
to their server, control calls that pass over a dead server."""

from __future__ import annotations

import anyio
import pytest

from engine.backends.base import SamplingParams
from engine.backends.pool import BackendPool
from engine.encoding import ChatEncoder
from engine.engine import EngineConfig, RolloutEngine
from engine.errors import BackendError, ErrorClass
from engine.scheduler.retry import RetryPolicy
from engine.trajectory import Status
from engine.turn import TurnLimits
from tests.fakes import DeterministicBackend
from tests.test_engine import env_factory, rows

LONG = SamplingParams(max_new_tokens=50, stop_token_ids=(2,))
SHORT = SamplingParams(max_new_tokens=2)
ENDLESS = SamplingParams(max_new_tokens=1_000_000)  # runs until aborted


class Dead(DeterministicBackend):
    """A server that cannot be reached for any control call."""

    def __init__(self, name: str = "http://dead:1", **kwargs):
        super().__init__(**kwargs)
        self.name = name

    async def _down(self, *args):
        raise BackendError(ErrorClass.CONNECTION, f"SGLang server at {self.name} is unreachable: ConnectError")

    pause = resume = abort = weight_version = _down


@pytest.mark.anyio
async def test_requests_go_to_the_least_loaded_server():
    servers = [DeterministicBackend(stop_every=10_000), DeterministicBackend(stop_every=10_000)]
    pool = BackendPool(servers)
    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(lambda i=i: pool.generate([i, 1, 2], LONG, rid=f"request-{i}"))
            await anyio.lowlevel.checkpoint()
        assert [s.max_running for s in servers] == [3, 3]
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_an_abort_reaches_only_the_server_holding_the_request():
    servers = [DeterministicBackend(stop_every=10_000), DeterministicBackend(stop_every=10_000)]
    pool = BackendPool(servers)
    results = {}

    async def run(i: int) -> None:
        results[i] = await pool.generate([i], LONG, rid=f"r{i}")

    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(run, i)
        while sum(len(s.running) for s in servers) < 2:
            await anyio.lowlevel.checkpoint()
        await pool.abort("r1")
    assert results[1].finish_reason == "abort" and len(results[1].token_ids) < 50
    assert results[0].finish_reason == "length" and len(results[0].token_ids) == 50


@pytest.mark.anyio
async def test_a_retry_after_a_connection_error_goes_to_another_server(tokenizer):
    down = DeterministicBackend(failures={n: BackendError(ErrorClass.CONNECTION, "refused") for n in range(1, 100)})
    up = DeterministicBackend()
    pool = BackendPool([down, up], cooldown_s=60)
    config = EngineConfig(
        n_samples_per_prompt=4, retry=RetryPolicy(backoff_base_s=0.0),
        limits=TurnLimits(max_turns=4), sampling=SamplingParams(max_new_tokens=16),
    )  # fmt: skip
    async with RolloutEngine(
        backend=pool, encoder=ChatEncoder(tokenizer), env_factory=env_factory(), source=rows(2), config=config
    ) as engine:
        groups = await engine.rollout(2)
        retries = engine.statistics().scheduler.retries
    assert all(t.status is Status.COMPLETED for g in groups for t in g.trajectories)
    # only requests sent before its first failure came back reached the down server; each was retried elsewhere
    assert 1 <= down.num_calls <= 4 and retries == {ErrorClass.CONNECTION: down.num_calls}
    assert pool.statistics()[0]["cooling_down"] == 1.0


@pytest.mark.anyio
async def test_a_session_stays_on_its_server_while_that_server_is_healthy():
    servers = [DeterministicBackend(stop_every=10_000), DeterministicBackend(stop_every=10_000)]
    pool = BackendPool(servers)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: pool.generate([1], ENDLESS, rid="busy", session_id="a"))
        await anyio.lowlevel.checkpoint()  # session a's server now has a request in flight
        for _ in range(3):
            await pool.generate([2], SHORT, session_id="a")  # its server, though it is the busier
            await pool.generate([3], SHORT, session_id="b")  # a new session: the least loaded
        await pool.abort("busy")
    assert servers[0].session_ids == ["a"] * 4
    assert servers[1].session_ids == ["b"] * 3


@pytest.mark.anyio
async def test_a_session_moves_when_its_server_fails_and_stays_where_it_moved():
    now = [0.0]
    flaky = DeterministicBackend(failures={2: BackendError(ErrorClass.CONNECTION, "refused")})
    other = DeterministicBackend()
    pool = BackendPool([flaky, other], cooldown_s=10, clock=lambda: now[0])
    await pool.generate([1], SHORT, session_id="a")
    with pytest.raises(BackendError):
        await pool.generate([1], SHORT, session_id="a")
    await pool.generate([1], SHORT, session_id="a")  # its server cools down: the other one
    now[0] = 100.0
    await pool.generate([1], SHORT, session_id="a")  # and there it stays
    assert flaky.session_ids == ["a", "a"] and other.session_ids == ["a", "a"]


def test_the_pool_remembers_the_latest_sessions_only():
    pool = BackendPool([DeterministicBackend(), DeterministicBackend()], max_sessions=2)
    for session in ("a", "b", "a", "c"):
        pool.pick(session)
    assert list(pool.placement.sessions) == ["a", "c"]


@pytest.mark.anyio
async def test_control_calls_pass_over_a_dead_server_and_fail_only_when_all_do(caplog):
    pool = BackendPool([Dead(), DeterministicBackend(weight_version="v3")])
    await pool.pause()
    await pool.resume()
    await pool.abort()
    assert await pool.weight_version() == "v3"
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 4 and all("server 0" in m and "http://dead:1 is unreachable" in m for m in failed)

    with pytest.raises(BackendError) as info:
        await BackendPool([Dead("http://a:1"), Dead("http://b:1")]).pause()
    assert info.value.error_class is ErrorClass.CONNECTION
    message = info.value.message
    assert message.startswith("BackendPool.pause failed on 2 of 2: server 0")
    assert "http://a:1 is unreachable" in message and "http://b:1 is unreachable" in message


@pytest.mark.anyio
async def test_weight_version_is_what_most_servers_report_and_a_disagreement_is_logged(caplog):
    versions = ["v1", "v2", "v2"]
    pool = BackendPool([DeterministicBackend(weight_version=v) for v in versions])
    assert await pool.weight_version() == "v2"
    [warning] = [r.getMessage() for r in caplog.records if "disagree" in r.getMessage()]
    assert "'v1'" in warning and warning.count("'v2'") == 3  # each server's, then the one used


@pytest.mark.anyio
async def test_health_is_any_server_and_a_tied_version_is_the_first():
    class Down(DeterministicBackend):
        async def health(self) -> bool:
            return False

    assert await BackendPool([Down(), DeterministicBackend(weight_version="v3")]).health()
    assert not await BackendPool([Down()]).health()
    assert await BackendPool([DeterministicBackend(weight_version="v7"), Down()]).weight_version() == "v7"
    with pytest.raises(ValueError, match="at least one backend"):
        BackendPool([])


@pytest.mark.anyio
async def test_a_listener_goes_to_the_server_picked_and_the_pool_streams_when_all_its_servers_do():
    class Unstreamed(DeterministicBackend):
        streams = False

    servers = [DeterministicBackend(stop_every=10_000), DeterministicBackend(stop_every=10_000)]
    pool, got = BackendPool(servers), []
    assert pool.streams and not BackendPool([servers[0], Unstreamed()]).streams
    result = await pool.generate([1, 2], LONG, rid="r", session_id="s", on_tokens=got.extend)
    assert got == result.token_ids and len(got) == 50
    assert sum(s.num_produced for s in servers) == 50


class Reporting(DeterministicBackend):
    """A server that reports what it runs for everyone (`GET /v1/loads`): `others` requests of other clients."""

    def __init__(self, others: int = 0, used_tokens: int = 0):
        super().__init__(stop_every=10_000)
        self.others, self.used_tokens, self.reads = others, used_tokens, 0
        self.read_twice = anyio.Event()

    async def reported_loads(self):
        from engine.backends.base import ReportedLoad

        self.reads += 1
        if self.reads == 2:
            self.read_twice.set()
        return [ReportedLoad(running=self.others, waiting=0, max_running=64, used_tokens=self.used_tokens)]


@pytest.mark.anyio
async def test_a_pool_given_load_poll_s_reads_what_every_server_reports_while_it_is_open():
    servers = [Reporting(others=24, used_tokens=90_000), Reporting(others=3)]
    async with BackendPool(servers, load_poll_s=0.01) as pool:
        await servers[0].read_twice.wait()
        await servers[1].read_twice.wait()  # the first read of each has been noted
        assert [(load.reported_requests, load.reported_tokens) for load in pool.loads()] == [(24, 90_000), (3, 0)]


@pytest.mark.anyio
async def test_what_the_servers_report_moves_a_session_off_a_server_other_clients_load():
    """Another shard keeps server 0 busy: once the pool has read the servers' loads, a session at home there moves
    to the other server, and new sessions that tie on live sessions go to the less loaded one."""
    servers = [Reporting(others=24, used_tokens=90_000), Reporting()]
    pool = BackendPool(servers)
    assert pool.pick("session-a") == 0  # all alike: the first server
    await pool.read_reported_loads()
    assert pool.pick("session-a") == 1  # its server is past the margin with the other shard's requests
    assert pool.pick("session-b") == 0 and pool.pick("session-c") == 1  # one live session each, then by load


@pytest.mark.anyio
async def test_a_server_whose_load_cannot_be_read_keeps_what_it_said_last():
    class Flaky(Reporting):
        async def reported_loads(self):
            if self.reads:
                raise BackendError(ErrorClass.CONNECTION, "unreachable")
            return await super().reported_loads()

    servers = [Flaky(others=5), Reporting(others=1)]
    pool = BackendPool(servers)
    await pool.read_reported_loads()
    await pool.read_reported_loads()  # the first server fails this time
    assert [load.reported_requests for load in pool.loads()] == [5, 1]
