"""Placement policies (engine/backends/affinity.py): new sessions by the live sessions each server holds, then by
load; sessions kept on their server, moved only past the margin, forgotten when their trajectory ends; servers
cooling down passed over; consistent hashing and round robin as sglang-router does them."""

from __future__ import annotations

from collections import Counter

import anyio
import pytest

from engine.backends.affinity import (
    AffinityPlacement,
    ConsistentHashPlacement,
    RoundRobinPlacement,
    ServerLoad,
    make_placement,
)
from engine.backends.base import SamplingParams
from engine.backends.pool import BackendPool
from engine.errors import BackendError, ErrorClass
from tests.fakes import DeterministicBackend

ENDLESS = SamplingParams(max_new_tokens=1_000_000)
SHORT = SamplingParams(max_new_tokens=2)


def loads(*tokens: int, down: tuple[int, ...] = ()) -> list[ServerLoad]:
    return [ServerLoad(num_requests=1 if t else 0, num_tokens=t, is_ready=i not in down) for i, t in enumerate(tokens)]


def test_a_new_session_goes_to_the_server_with_fewest_tokens_in_flight_when_each_holds_as_many_sessions():
    assert AffinityPlacement(3).place("a", loads(9000, 100, 5000)) == 1
    # tokens first, requests break a tie
    tied = [ServerLoad(num_requests=3, num_tokens=10), ServerLoad(num_requests=1, num_tokens=10)]
    placement = AffinityPlacement(2)
    assert placement.place("b", tied) == 1
    assert placement.statistics() == {"num_placed": 1, "num_stayed": 0, "num_moved": 0}


def test_a_new_session_goes_to_the_server_home_to_the_fewest_live_sessions_whatever_runs_there_now():
    placement = AffinityPlacement(2)
    assert placement.place("a", loads(5000, 0)) == 1
    # server 1's session is in its env, so server 1 runs nothing now; server 0 runs other work but holds no session
    assert placement.place("b", loads(5000, 0)) == 0
    assert placement.place("c", loads(5000, 0)) == 1  # one each: tokens in flight decide
    assert placement.residents == [1, 2]


def test_an_ended_session_no_longer_counts_on_its_server_and_comes_back_as_new():
    placement = AffinityPlacement(2)
    assert [placement.place(s, loads(0, 0)) for s in ("a", "b", "c")] == [0, 1, 0]
    placement.end("a")
    placement.end("never-seen")  # nothing to forget
    assert placement.residents == [1, 1] and list(placement.sessions) == ["b", "c"]
    assert placement.place("d", loads(0, 10)) == 0
    placement.place("a", loads(0, 0))
    assert placement.statistics()["num_placed"] == 5


def test_a_moved_session_counts_on_its_new_server_and_the_oldest_forgotten_on_its_own():
    placement = AffinityPlacement(2, move_margin=0.25, move_slack_tokens=1000, max_sessions=2)
    placement.place("a", loads(0, 10))
    assert placement.place("a", loads(30_000, 2_000)) == 1
    assert placement.residents == [0, 1]
    placement.place("b", loads(0, 0))  # server 0: it holds none
    placement.place("c", loads(0, 0))  # one each: server 0 by index; "a", the least recent of 3, is forgotten
    assert list(placement.sessions) == ["b", "c"] and placement.residents == [2, 0]


def test_a_session_stays_on_its_server_within_the_margin():
    placement = AffinityPlacement(2, move_margin=0.25, move_slack_tokens=1000)
    assert placement.place("a", loads(0, 10)) == 0
    # home holds 11,000, the mean is 10,500: under 1.25 x 10,500 + 1,000, so it stays although it is the busier
    assert placement.place("a", loads(11_000, 10_000)) == 0
    assert placement.statistics()["num_stayed"] == 1


def test_a_session_moves_once_its_server_is_past_the_margin_and_stays_where_it_moved():
    placement = AffinityPlacement(2, move_margin=0.25, move_slack_tokens=1000)
    placement.place("a", loads(0, 10))
    # home 30,000, mean 16,000: past 1.25 x 16,000 + 1,000 = 21,000
    assert placement.place("a", loads(30_000, 2_000)) == 1
    assert placement.place("a", loads(30_000, 3_000)) == 1
    assert placement.statistics() == {"num_placed": 1, "num_stayed": 1, "num_moved": 1}


def test_a_server_cooling_down_is_passed_over_by_every_policy():
    for policy in ("round_robin", "consistent_hash", "affinity"):
        placement = make_placement(policy, 3)
        chosen = {placement.place(f"s{i}", loads(0, 0, 0, down=(1,))) for i in range(30)}
        assert 1 not in chosen, policy
    placement = AffinityPlacement(2)
    placement.place("a", loads(0, 10))
    assert placement.place("a", loads(0, 10, down=(0,))) == 1  # its server is down: it moves at once
    assert placement.place("x", loads(0, 0, down=(0, 1))) in (0, 1)  # all down: one of them still


def test_consistent_hashing_keeps_a_key_on_one_server_whatever_the_load_and_spreads_keys():
    placement = ConsistentHashPlacement(8)
    first = placement.place("trajectory-1", loads(*[0] * 8))
    busy = [0] * 8
    busy[first] = 10**9
    assert placement.place("trajectory-1", loads(*busy)) == first  # it knows nothing of load
    spread = Counter(placement.place(f"t{i}", loads(*[0] * 8)) for i in range(8000))
    assert len(spread) == 8 and max(spread.values()) < 2 * min(spread.values())
    # its server down, the key moves clockwise; back up, the key comes back
    assert placement.place("trajectory-1", loads(*[0] * 8, down=(first,))) != first
    assert placement.place("trajectory-1", loads(*[0] * 8)) == first


def test_round_robin_ignores_sessions():
    placement = RoundRobinPlacement(3)
    assert [placement.place("a", loads(0, 0, 0)) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_an_unknown_policy_and_a_negative_margin_are_refused():
    with pytest.raises(ValueError, match="unknown placement policy 'random'; known: round_robin"):
        make_placement("random", 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="move_margin and move_slack_tokens must be >= 0"):
        AffinityPlacement(2, move_margin=-1)


@pytest.mark.anyio
async def test_the_pool_counts_prompt_tokens_in_flight_and_places_by_them():
    servers = [DeterministicBackend(stop_every=10_000), DeterministicBackend(stop_every=10_000)]
    pool = BackendPool(servers, policy="affinity", move_slack_tokens=0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: pool.generate(list(range(5000)), ENDLESS, rid="long", session_id="long"))
        await anyio.lowlevel.checkpoint()
        assert [s["inflight_tokens"] for s in pool.statistics()] == [5000, 0]
        # a short session goes to the server holding none; the next, with one session on each, by tokens
        for name in ("a", "b"):
            tg.start_soon(lambda name=name: pool.generate([1, 2, 3], ENDLESS, rid=name, session_id=name))
            await anyio.lowlevel.checkpoint()
        assert [s["inflight"] for s in pool.statistics()] == [1, 2]
        await pool.abort()
    assert [s["inflight_tokens"] for s in pool.statistics()] == [0, 0]
    assert servers[0].session_ids == ["long"] and sorted(servers[1].session_ids) == ["a", "b"]


@pytest.mark.anyio
async def test_the_engine_ends_each_trajectorys_session_in_the_pool(tokenizer):
    from engine.encoding import ChatEncoder
    from engine.engine import RolloutEngine
    from tests.test_engine import config, env_factory, rows

    failing = {1: BackendError(ErrorClass.CLIENT, "HTTP 400")}  # one trajectory fails: not retried
    pool = BackendPool([DeterministicBackend(failures=failing), DeterministicBackend()], policy="affinity")
    ended: list[str] = []
    end_session = pool.end_session
    pool.end_session = lambda session_id: (ended.append(session_id), end_session(session_id))
    async with RolloutEngine(
        backend=pool, encoder=ChatEncoder(tokenizer), env_factory=env_factory(), source=rows(4),
        config=config(n_samples_per_prompt=2),
    ) as engine:  # fmt: skip
        groups = await engine.rollout(4)
    statuses = sorted(str(t.status) for g in groups for t in g.trajectories)
    assert statuses.count("failed") == 1 and statuses.count("completed") == 7
    assert sorted(ended) == sorted(t.session_id for g in groups for t in g.trajectories)
    assert pool.placement.sessions == {} and pool.placement.residents == [0, 0]


@pytest.mark.anyio
async def test_a_server_that_failed_is_left_until_its_cooldown_ends():
    now = [0.0]
    flaky = DeterministicBackend(failures={1: BackendError(ErrorClass.SERVER, "HTTP 503")})
    other = DeterministicBackend()
    pool = BackendPool([flaky, other], policy="consistent_hash", cooldown_s=10, clock=lambda: now[0])
    home = pool.pick("s")
    pool.backends[home], pool.backends[1 - home] = flaky, other
    with pytest.raises(BackendError):
        await pool.generate([1], SHORT, session_id="s")
    await pool.generate([1], SHORT, session_id="s")
    now[0] = 11.0
    await pool.generate([1], SHORT, session_id="s")
    assert flaky.session_ids == ["s", "s"] and other.session_ids == ["s"]


@pytest.mark.anyio
async def test_a_backend_failing_to_end_a_session_fails_no_trajectory(tokenizer, caplog):
    from engine.encoding import ChatEncoder
    from engine.engine import RolloutEngine
    from tests.test_engine import config, env_factory, rows

    class Refusing(DeterministicBackend):
        def end_session(self, session_id: str) -> None:
            raise RuntimeError("no such session")

    async with RolloutEngine(
        backend=Refusing(), encoder=ChatEncoder(tokenizer), env_factory=env_factory(), source=rows(2),
        config=config(n_samples_per_prompt=2),
    ) as engine:  # fmt: skip
        groups = await engine.rollout(2)
    assert [str(t.status) for g in groups for t in g.trajectories] == ["completed"] * 4
    assert caplog.text.count("ending session") == 4 and "no such session" in caplog.text


def test_a_pool_with_a_placement_that_keeps_no_sessions_has_none_to_end():
    class First:
        name = "first"

        def place(self, session_id, loads):
            return 0

        def statistics(self):
            return {}

    pool = BackendPool([DeterministicBackend(), DeterministicBackend()], policy=First())
    pool.end_session("s")  # nothing to forget, and no error
    assert pool.pick("s") == 0
