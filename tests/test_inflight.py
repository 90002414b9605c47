"""Groups in flight sized by the servers' own load (in_flight auto, engine/scheduler/inflight.py): one more while
the servers have room, fewer when requests queue, the KV cache fills or too many sessions come back stale, always
between the step's target and its ceiling; SGLang's `GET /v1/loads` read as it answers; and servers that report no
load leave the step at over_sampling x its target, as in_flight fixed does. The SGLang tier reads a real server's."""

from __future__ import annotations

import logging

import httpx2
import pytest

import engine.engine as engine_module
from engine.backends.base import ReportedLoad
from engine.backends.pool import BackendPool
from engine.backends.sglang import SGLangBackend
from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine
from engine.errors import BackendError, ErrorClass
from engine.scheduler.inflight import InFlightSizer
from tests.fakes import DeterministicBackend
from tests.test_engine import config, env_factory, rows

ROOM = [ReportedLoad(running=2, waiting=0, max_running=16)]
QUEUE = [ReportedLoad(running=16, waiting=20, max_running=16)]  # more than a whole batch waiting
KV_FULL = [ReportedLoad(running=4, waiting=0, max_running=16, token_usage=0.97)]
BUSY = [ReportedLoad(running=16, waiting=3, max_running=16)]  # full, a few queued: held


def test_the_size_starts_slow_grows_within_each_steps_cap_shrinks_under_pressure_and_stays_within_bounds():
    sizer = InFlightSizer(floor=4, ceiling=20)
    assert sizer.goal == 4 and sizer.cap == 8  # slow start: a step may double it
    assert sizer.observe(ROOM) and sizer.goal == 5  # 4 x 1.25 a reading
    sizer.observe(ROOM)
    assert sizer.goal == 7  # 6.25
    sizer.observe(ROOM)
    sizer.observe(ROOM)
    assert sizer.goal == 8 and not sizer.observe(ROOM)  # the step's most
    assert not sizer.observe(BUSY) and sizer.goal == 8
    sizer.observe(QUEUE)
    assert sizer.goal == 7  # 8 x 0.8 = 6.4, at once
    sizer.step_began()  # no longer starting: a step may grow it by a tenth, one group at least
    assert sizer.cap == 6.4 + 1
    assert sizer.observe(ROOM) and sizer.goal == 8 and not sizer.observe(ROOM)
    sizer.observe(KV_FULL)
    assert sizer.goal == 6  # 7.4 x 0.8 = 5.92
    for _ in range(10):
        sizer.observe(QUEUE)
    assert sizer.goal == 4  # never under the step's target
    for _ in range(30):
        sizer.step_began()
        for _ in range(5):
            sizer.observe(ROOM)
    assert sizer.goal == 20  # never over the ceiling
    assert sizer.changes["down"] == 4  # 8 to 7, 7 to 6, then 6 to 5 and 5 to 4: goals that fell
    with pytest.raises(ValueError, match="floor <= ceiling"):
        InFlightSizer(floor=5, ceiling=4)


def test_sessions_about_to_go_stale_shrink_the_size_and_hold_it_before_any_comes_back_stale():
    """The brake reads ahead: sessions still running as old as the bound allows (doomed) shrink the size at the
    step's end, a version younger (at risk) hold it; sessions that came back stale count too, smoothed."""
    sizer = InFlightSizer(floor=2, ceiling=10)
    sizer.groups = 10.0
    sizer.step_ended(stale=0, sessions=16, doomed=4)  # 25% of a step's sessions will come back stale
    assert sizer.goal == 9 and sizer.holding and sizer.changes["stale"] == 1 and not sizer.starting
    sizer.step_began()
    assert not sizer.observe(ROOM) and sizer.goal == 9  # room, but held
    sizer.step_ended(stale=0, sessions=16, doomed=0, at_risk=8)  # half are a version from doomed: held still
    assert sizer.holding and sizer.goal == 9 and sizer.changes["stale"] == 1
    sizer.step_ended(stale=4, sessions=16)  # 25% came back stale, smoothed: 12.5%
    assert sizer.groups == pytest.approx(8.1)  # 9 x 0.9
    sizer.step_ended(stale=0, sessions=16)  # 6.25% smoothed: under the hold
    sizer.step_began()
    assert not sizer.holding and sizer.observe(ROOM) and sizer.goal == 10  # 9.1: a group a reading


# -- SGLang's GET /v1/loads ---------------------------------------------------------------------------------------


def loads_transport(reply: httpx2.Response) -> httpx2.MockTransport:
    def handle(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/v1/loads":
            assert request.url.params["include"] == "core"
            return reply
        return httpx2.Response(404, json={"detail": "Not Found"})  # no /workers: a server, not a router

    return httpx2.MockTransport(handle)


@pytest.mark.anyio
async def test_sglangs_v1_loads_is_read_summed_over_its_data_parallel_ranks():
    ranks = [
        {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 1, "max_running_requests": 8, "token_usage": 0.5},
        {"dp_rank": 1, "num_running_reqs": 5, "num_waiting_reqs": 0, "max_running_requests": 8, "token_usage": 0.7},
    ]
    reply = httpx2.Response(200, json={"version": "0.5.23", "loads": ranks})
    async with SGLangBackend("http://sglang.test", transport=loads_transport(reply)) as backend:
        assert await backend.reported_loads() == [ReportedLoad(running=8, waiting=1, max_running=16, token_usage=0.7)]
        async with BackendPool([backend, backend]) as pool:
            assert len(await pool.reported_loads()) == 2


@pytest.mark.anyio
async def test_a_server_without_v1_loads_reports_none_and_a_reply_not_in_its_shape_is_malformed():
    async with SGLangBackend("http://sglang.test", transport=loads_transport(httpx2.Response(404))) as backend:
        assert await backend.reported_loads() is None
    bad = httpx2.Response(200, json={"loads": [{"dp_rank": 0, "num_running_reqs": 3}]})
    async with SGLangBackend("http://sglang.test", transport=loads_transport(bad)) as backend:
        with pytest.raises(BackendError, match="no load per rank") as raised:
            await backend.reported_loads()
    assert raised.value.error_class is ErrorClass.MALFORMED


# -- the engine ---------------------------------------------------------------------------------------------------


class ReportingBackend(DeterministicBackend):
    """Reports the scripted load (None: its servers serve no /v1/loads)."""

    def __init__(self, loads: list[ReportedLoad] | None):
        super().__init__(stop_every=4)
        self.loads, self.polls = loads, 0

    async def reported_loads(self) -> list[ReportedLoad] | None:
        self.polls += 1
        return self.loads


async def first_step(backend, encoder, *, target: int = 2, **overrides) -> tuple[RolloutEngine, int]:
    """The engine after one step of `target` groups, and how many groups it admitted in that step."""
    settings = config(partial_rollout=True, over_sampling=3.0, max_inflight=64, **{"in_flight": "auto", **overrides})
    engine = RolloutEngine(backend=backend, encoder=encoder, env_factory=env_factory(), source=rows(40, turns=4),
                           config=settings)  # fmt: skip
    async with engine:
        groups = await engine.rollout(target)
        assert len(groups) == target
        return engine, engine.statistics().num_prompts_admitted


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


@pytest.fixture
def every_loop_turn(monkeypatch):
    """The sizer reads the load at every turn of the loop rather than every half second."""
    monkeypatch.setattr(engine_module, "SIZING_INTERVAL_S", 0.0)


@pytest.mark.anyio
async def test_with_room_on_the_servers_a_step_keeps_more_groups_in_flight_as_far_as_a_step_grows(
    encoder, every_loop_turn
):
    backend = ReportingBackend(ROOM)
    engine, admitted = await first_step(backend, encoder, target=2)
    assert engine.sizer is not None and engine.sizer.goal == 4  # slow start: the first step doubles its target
    assert admitted > 2 and backend.polls > 0


@pytest.mark.anyio
async def test_with_requests_queued_on_the_servers_a_step_keeps_only_its_target_in_flight(encoder, every_loop_turn):
    engine, admitted = await first_step(ReportingBackend(QUEUE), encoder, target=2)
    assert engine.sizer.goal == 2 and admitted == 2  # fixed would have admitted 6


@pytest.mark.anyio
@pytest.mark.parametrize("backend", ["no reported_loads", "no /v1/loads"])
async def test_servers_that_report_no_load_leave_the_step_at_over_sampling_x_its_target(
    encoder, every_loop_turn, caplog, backend
):
    backend = DeterministicBackend(stop_every=4) if backend == "no reported_loads" else ReportingBackend(None)
    with caplog.at_level(logging.INFO, logger="engine.engine"):
        engine, admitted = await first_step(backend, encoder, target=2)
    assert engine.sizer is None and admitted == 6
    assert "in_flight auto" in caplog.text and "over_sampling x the step's target stays in flight" in caplog.text


@pytest.mark.anyio
async def test_in_flight_fixed_keeps_over_sampling_x_the_target_whatever_the_servers_say(encoder, every_loop_turn):
    backend = ReportingBackend(QUEUE)
    engine, admitted = await first_step(backend, encoder, target=2, in_flight="fixed")
    assert engine.sizer is None and admitted == 6 and backend.polls == 0


@pytest.mark.sglang
@pytest.mark.anyio
async def test_a_real_sglang_server_reports_its_load(sglang_workers):
    async with SGLangBackend(sglang_workers[0].url) as backend:
        (load,) = await backend.reported_loads()
    assert load.max_running > 0 and load.running >= 0 and load.waiting >= 0 and 0.0 <= load.token_usage <= 1.0
