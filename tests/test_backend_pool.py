"""BackendPool: least-loaded servers, retries that land elsewhere, aborts routed to their server."""

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
async def test_health_is_any_server_and_version_is_the_first():
    class Down(DeterministicBackend):
        async def health(self) -> bool:
            return False

    assert await BackendPool([Down(), DeterministicBackend(weight_version="v3")]).health()
    assert not await BackendPool([Down()]).health()
    assert await BackendPool([DeterministicBackend(weight_version="v7"), Down()]).weight_version() == "v7"
    with pytest.raises(ValueError, match="at least one backend"):
        BackendPool([])
