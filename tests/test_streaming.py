"""A trajectory's token listener (engine/turn.py, engine/scheduler/scheduler.py): the tokens of its turns as they
are generated, through pauses, broken streams, cut turns and listeners that fail; on the scripted backends."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import anyio
import pytest

from engine.backends.base import STREAM_BROKEN, GenerateResult, SamplingParams
from engine.encoding import ChatEncoder
from engine.envs.base import EnvRunner
from engine.errors import ErrorClass, ResponseError
from engine.scheduler.reference import run_trajectory
from engine.scheduler.retry import CircuitBreaker, RetryPolicy
from engine.scheduler.scheduler import Scheduler
from engine.trajectory import Status, StopReason, Trajectory
from engine.turn import TurnLimits, generate_turn
from tests.fakes import DeterministicBackend, Listener, ScriptedBackend, ScriptedEnv

PROMPT = [{"role": "user", "content": "Count."}]


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


def scheduler_over(encoder, backend, *, max_new_tokens=64, **options) -> Scheduler:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=encoder.stop_token_ids)
    return Scheduler(
        backend=backend, encoder=encoder, sampling=sampling, limits=TurnLimits(max_turns=4),
        retry=RetryPolicy(per_turn={ErrorClass.SERVER: 2}, backoff_base_s=0.0, env_step_timeout_s=None),
        breaker=CircuitBreaker(), max_generating=4, max_env_steps=4, **options,
    )  # fmt: skip


def generated(trajectory: Trajectory) -> list[int]:
    return [t for turn in trajectory.turns for t in trajectory.generated_ids(turn).tolist()]


def reply(encoder, *ids: int) -> list[int]:
    return [*ids, encoder.end_of_turn_id]


@pytest.mark.anyio
async def test_every_turn_streams_its_tokens_to_the_listener_once(encoder):
    backend = ScriptedBackend([reply(encoder, 11, 12), reply(encoder, 13, 14, 15)])
    trajectory, listener = Trajectory(prompt=list(PROMPT)), Listener()
    trajectory.token_listener = listener
    env = ScriptedEnv([{"role": "user", "content": "more"}, {"role": "user", "content": "done"}])
    scheduler = scheduler_over(encoder, backend)
    await scheduler.drive(trajectory, lambda: EnvRunner(env))
    assert trajectory.status is Status.COMPLETED
    assert listener.tokens == generated(trajectory) == [*reply(encoder, 11, 12), *reply(encoder, 13, 14, 15)]
    assert len(listener.calls) == len(listener.tokens)  # one call per token, as the backend made them
    assert all(request.is_streamed for request in backend.requests)


@pytest.mark.anyio
async def test_without_a_listener_or_a_streaming_backend_nothing_streams(encoder):
    class Unstreamed(ScriptedBackend):
        streams = False

        async def generate(self, input_ids, sampling_params, image_data=None, *, rid=None, session_id=None):
            return await super().generate(input_ids, sampling_params, image_data, rid=rid, session_id=session_id)

    plain = ScriptedBackend([reply(encoder, 5)])
    await run_trajectory(
        Trajectory(prompt=list(PROMPT)), backend=plain, env=EnvRunner(ScriptedEnv([{"role": "user", "content": "ok"}])),
        encoder=encoder, sampling=SamplingParams(max_new_tokens=8), limits=TurnLimits(),
    )  # fmt: skip
    assert not plain.requests[0].is_streamed  # no listener: the backend is asked as it always was

    unstreamed, trajectory, listener = Unstreamed([reply(encoder, 5)]), Trajectory(prompt=list(PROMPT)), Listener()
    trajectory.token_listener = listener
    await run_trajectory(
        trajectory, backend=unstreamed, env=EnvRunner(ScriptedEnv([{"role": "user", "content": "ok"}])),
        encoder=encoder, sampling=SamplingParams(max_new_tokens=8), limits=TurnLimits(),
    )  # fmt: skip
    assert trajectory.status is Status.COMPLETED and listener.calls == []


@pytest.mark.anyio
async def test_a_listener_that_raises_is_cleared_counted_and_ends_nothing(encoder, caplog):
    def failing(token_ids: list[int]) -> None:
        raise RuntimeError("the agent's connection is gone")

    backend = ScriptedBackend([reply(encoder, 11, 12, 13), reply(encoder, 14)])
    trajectory = Trajectory(prompt=list(PROMPT))
    trajectory.token_listener = failing
    env = ScriptedEnv([{"role": "user", "content": "more"}, {"role": "user", "content": "done"}])
    scheduler = scheduler_over(encoder, backend)
    with caplog.at_level(logging.WARNING):
        await scheduler.drive(trajectory, lambda: EnvRunner(env))
    assert (trajectory.status, generated(trajectory)) == (
        Status.COMPLETED,
        [*reply(encoder, 11, 12, 13), *reply(encoder, 14)],
    )
    assert trajectory.token_listener is None and not trajectory.errors
    assert scheduler.statistics().num_listener_failures == 1
    assert caplog.text.count("token listener raised") == 1
    assert [r.is_streamed for r in backend.requests] == [True, False]  # cleared: the next turn is not streamed


@pytest.mark.anyio
async def test_a_turn_paused_mid_stream_streams_only_its_new_tokens_once_resumed(encoder):
    backend = DeterministicBackend(stop_every=10**9)  # no stop token: every turn runs to max_new_tokens
    scheduler = scheduler_over(encoder, backend, max_new_tokens=40)
    trajectory, listener = Trajectory(prompt=list(PROMPT)), Listener()
    trajectory.token_listener = listener
    env = ScriptedEnv([{"role": "user", "content": "done"}])
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(scheduler.drive, trajectory, lambda: EnvRunner(env))
            await listener.reached(5).wait()
            await scheduler.pause_generation()  # aborts the request: the turn keeps what it made
            paused_at = len(listener.tokens)
            scheduler.resume_generation("v0")
    first = trajectory.turns[0]
    assert 5 <= paused_at < 40 and len(trajectory.spans) >= 2  # generated in two calls at least
    assert listener.tokens == trajectory.generated_ids(first).tolist() and first.num_generated == 40


@pytest.mark.anyio
@pytest.mark.parametrize("end_on_abort", [False, True])
async def test_a_broken_stream_is_a_counted_server_retry_that_goes_on_from_its_tokens(encoder, end_on_abort):
    broken = GenerateResult([11, 12], [-0.5, -0.5], "", "abort", "v0", meta={STREAM_BROKEN: "connection reset"})
    backend = ScriptedBackend([broken, reply(encoder, 13, 14)])
    scheduler = scheduler_over(encoder, backend, end_on_abort=end_on_abort)
    trajectory, listener = Trajectory(prompt=list(PROMPT)), Listener()
    trajectory.token_listener = listener
    await scheduler.drive(trajectory, lambda: EnvRunner(ScriptedEnv([{"role": "user", "content": "done"}])))
    assert (trajectory.status, trajectory.stop_reason) == (Status.COMPLETED, StopReason.ENV_DONE)
    assert listener.tokens == generated(trajectory) == [11, 12, *reply(encoder, 13, 14)]  # none lost, none twice
    assert len(trajectory.turns) == 1 and trajectory.turns[0].retries == 1
    assert scheduler.statistics().retries == {ErrorClass.SERVER: 1}
    assert backend.requests[1].input_ids[-2:] == [11, 12]  # continued from the tokens that came
    assert backend.requests[1].sampling_params.max_new_tokens == 64 - 2


@pytest.mark.anyio
async def test_a_stream_broken_at_the_turns_cap_ends_the_turn_as_a_length(encoder):
    broken = GenerateResult([11, 12, 13, 14], [-0.5] * 4, "", "abort", "v0", meta={STREAM_BROKEN: "reset"})
    backend = ScriptedBackend([broken])
    scheduler = scheduler_over(encoder, backend, max_new_tokens=4)
    trajectory = Trajectory(prompt=list(PROMPT))
    await scheduler.drive(trajectory, lambda: EnvRunner(ScriptedEnv([{"role": "user", "content": "done"}])))
    assert trajectory.status is Status.COMPLETED and len(backend.requests) == 1
    assert trajectory.turns[0].finish_reason == "length" and not scheduler.statistics().retries


@pytest.mark.anyio
async def test_a_turn_cut_at_a_vision_token_streams_nothing_past_the_cut():
    vision = SimpleNamespace(
        vision_token_ids=frozenset({999}), tokenizer=SimpleNamespace(convert_ids_to_tokens=lambda t: "<|image_pad|>")
    )
    backend = ScriptedBackend([[1, 2, 999, 3, 4]])
    trajectory, listener = Trajectory(prompt="text"), Listener()
    trajectory.set_prompt([7, 8])
    trajectory.token_listener = listener
    with pytest.raises(ResponseError):
        await generate_turn(trajectory, backend, SamplingParams(max_new_tokens=8), TurnLimits(), encoder=vision)
    assert listener.tokens == generated(trajectory) == [1, 2]
