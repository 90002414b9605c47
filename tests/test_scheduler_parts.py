"""The scheduler's parts on their own: priority slots, retry budgets, the breaker, weight versions."""

from __future__ import annotations

import random

import anyio
import pytest

from engine.errors import BackendError, EnvError, ErrorClass
from engine.scheduler.partial import VersionClock, mask_offpolicy
from engine.scheduler.queue import Policy, PriorityLimiter, priority_key
from engine.scheduler.retry import CircuitBreaker, RetryBudget, RetryPolicy
from engine.trajectory import Trajectory

# -- PriorityLimiter ----------------------------------------------------------------------------


async def _acquire_in_order(limiter: PriorityLimiter, keys: list[tuple], order: list[int]) -> None:
    """Queue one waiter per key (in list order) and record the order they are served in."""

    async def waiter(i: int) -> None:
        await limiter.acquire(keys[i])
        order.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(len(keys)):
            tg.start_soon(waiter, i)
            await anyio.wait_all_tasks_blocked()
        for _ in keys:
            limiter.release()
            await anyio.wait_all_tasks_blocked()


@pytest.mark.anyio
async def test_waiters_are_served_by_key_then_arrival():
    limiter = PriorityLimiter(1)
    await limiter.acquire()
    order: list[int] = []
    await _acquire_in_order(limiter, [(3,), (1,), (2,), (1,)], order)
    assert order == [1, 3, 2, 0]


@pytest.mark.anyio
async def test_holders_never_exceed_total():
    limiter = PriorityLimiter(3)
    peak = holding = 0

    async def hold() -> None:
        nonlocal peak, holding
        await limiter.acquire()
        holding += 1
        peak = max(peak, holding)
        await anyio.lowlevel.checkpoint()
        holding -= 1
        limiter.release()

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(hold)
    assert peak == 3 and limiter.statistics().borrowed == 0


@pytest.mark.anyio
async def test_closed_limiter_holds_waiters_and_serves_those_who_waited_through_it_first():
    limiter = PriorityLimiter(1)
    limiter.close()
    order: list[str] = []

    async def waiter(name: str, key: tuple) -> None:
        await limiter.acquire(key)
        order.append(name)
        limiter.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, "parked", (9,))
        await anyio.wait_all_tasks_blocked()
        assert order == [] and limiter.statistics().waiting == 1
        limiter.open()
        limiter.close()  # a second pause before the parked one ran
        tg.start_soon(waiter, "late", (0,))  # a better key, but it arrived after the first pause
        await anyio.wait_all_tasks_blocked()
        limiter.open()
    assert order == ["parked", "late"]


@pytest.mark.anyio
async def test_a_cancelled_waiter_leaves_no_slot_behind():
    limiter = PriorityLimiter(1)
    await limiter.acquire()
    async with anyio.create_task_group() as tg:
        tg.start_soon(limiter.acquire, ())
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    limiter.release()
    assert limiter.statistics().borrowed == 0 and limiter.statistics().waiting == 0
    await limiter.acquire()  # the slot is free
    assert limiter.statistics().borrowed == 1


def test_policies_order_ready_turns():
    young, old = Trajectory(prompt=[]), Trajectory(prompt=[])
    young.id, old.id = 20, 10
    left = {20: 1, 10: 3}
    assert priority_key(Policy.OLDEST, old, lambda t: left[t.id]) < priority_key(Policy.OLDEST, young, lambda t: 0)
    group_first = priority_key(Policy.GROUP_COMPLETION, young, lambda t: left[t.id])
    assert group_first < priority_key(Policy.GROUP_COMPLETION, old, lambda t: left[t.id])
    assert priority_key(Policy.FIFO, young, lambda t: 0) == priority_key(Policy.FIFO, old, lambda t: 0) == ()


# -- retry budgets and the breaker --------------------------------------------------------------


def test_per_turn_budgets_are_per_class_and_reset_each_turn():
    policy = RetryPolicy(per_turn={ErrorClass.SERVER: 2, ErrorClass.ENV_TIMEOUT: 1}, per_trajectory=10)
    budget = RetryBudget(policy)
    server, timeout = BackendError(ErrorClass.SERVER, "503"), EnvError(ErrorClass.ENV_TIMEOUT, "slow")
    assert [budget.charge(server, 0), budget.charge(server, 0), budget.charge(server, 0)] == [0, 1, None]
    assert budget.charge(timeout, 0) == 0 and budget.charge(timeout, 0) is None
    assert budget.total == 3
    assert budget.charge(server, 1) == 0  # a new turn, a fresh per-turn budget
    assert budget.charge(BackendError(ErrorClass.CLIENT, "400"), 1) is None  # not retried at all
    assert budget.total == 4


def test_the_trajectory_total_caps_all_classes():
    budget = RetryBudget(RetryPolicy(per_trajectory=3))
    error = BackendError(ErrorClass.CONNECTION, "refused")
    assert [budget.charge(error, turn) for turn in range(5)] == [0, 0, 0, None, None]


def test_backoff_is_exponential_with_full_jitter_and_capped():
    policy = RetryPolicy(backoff_base_s=0.1, backoff_max_s=1.0)
    rng = random.Random(0)
    for attempt in range(8):
        delays = [policy.backoff(attempt, rng) for _ in range(200)]
        cap = min(1.0, 0.1 * 2**attempt)
        assert min(delays) >= 0 and max(delays) <= cap and max(delays) > cap * 0.8


def test_breaker_opens_over_the_threshold_and_closes_as_the_window_moves(caplog):
    now = [0.0]
    breaker = CircuitBreaker(threshold=0.5, window_s=10, min_attempts=4, clock=lambda: now[0])
    for ok in (True, False, False):
        breaker.record(ok)
    assert not breaker.is_open  # too few attempts to judge
    breaker.record(False)
    assert breaker.is_open and breaker.statistics().failures == 3
    assert "breaker open: 3 of the last 4 attempts failed" in caplog.text
    now[0] = 11.0
    assert not breaker.is_open and breaker.statistics().times_opened == 1


# -- weight versions ----------------------------------------------------------------------------


def test_staleness_counts_versions_since_the_oldest_tokens():
    clock = VersionClock("v0")
    trajectory = Trajectory(prompt=[])
    trajectory.set_prompt([1, 2])
    trajectory.append_generation([5, 6], [-0.1, -0.2], "v0")
    clock.advance("v1")
    trajectory.append_observation([7])
    trajectory.append_generation([8, 9, 10], [-0.3] * 3, "v1")
    assert clock.staleness(trajectory) == 1
    clock.advance("v2")
    assert clock.staleness(trajectory) == 2
    clock.observe("v3")  # a version the backend reports before anyone announced it
    assert clock.current == "v3" and clock.age("v1") == 2


def test_mask_offpolicy_zeroes_tokens_of_older_versions_only():
    clock = VersionClock("v0")
    trajectory = Trajectory(prompt=[])
    trajectory.set_prompt([1])
    trajectory.append_generation([5, 6], [-0.1, -0.2], "v0")
    trajectory.append_observation([7])
    clock.advance("v1")
    trajectory.append_generation([8, 9], [-0.3, -0.4], "v1")
    assert mask_offpolicy(trajectory, clock) == 2
    assert trajectory.loss_mask.tolist() == [0, 0, 0, 1, 1]
    assert trajectory.logprobs.tolist()[:2] == pytest.approx([-0.1, -0.2])  # log-probs are kept
