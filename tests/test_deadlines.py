"""The shared timeout watcher of env calls (engine/envs/deadlines.py)."""

from __future__ import annotations

import anyio
import pytest

from engine.envs.deadlines import Deadlines


async def _hang() -> None:
    await anyio.Event().wait()


@pytest.mark.anyio
async def test_calls_past_their_timeout_are_cancelled_and_the_others_run_on():
    deadlines = Deadlines()
    outcomes: dict[str, bool] = {}
    short_ended = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(deadlines.watch)
        await anyio.wait_all_tasks_blocked()
        assert deadlines.is_watching

        async def call(name: str, timeout: float, work) -> None:
            with deadlines.after(timeout) as scope:
                await work()
            outcomes[name] = scope.cancelled_caught
            if name == "short timeout, hangs":
                short_ended.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as calls:
                calls.start_soon(call, "long timeout, hangs", 60.0, _hang)  # files a late deadline first
                calls.start_soon(call, "short timeout, hangs", 0.05, _hang)  # an earlier one: wakes the watcher
                calls.start_soon(call, "returns", 0.05, anyio.lowlevel.checkpoint)
                await short_ended.wait()
                calls.cancel_scope.cancel()  # the 60 s one is still waiting, as it should
        tg.cancel_scope.cancel()
    assert outcomes == {"returns": False, "short timeout, hangs": True}
    assert all(not filed for filed in deadlines._filed.values())  # nothing stays filed after its call
    assert not deadlines.is_watching


@pytest.mark.anyio
async def test_without_a_watcher_each_call_keeps_its_own_timer():
    deadlines = Deadlines()
    with anyio.fail_after(10), deadlines.after(0.05) as scope:
        await _hang()
    assert scope.cancelled_caught and deadlines._filed == {}
