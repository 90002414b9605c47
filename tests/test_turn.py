"""The sequential reference loop: stop reasons, budgets, masks, and failures that end one trajectory only."""

from __future__ import annotations

import anyio
import pytest

from engine.backends.base import SamplingParams
from engine.encoding import ChatEncoder
from engine.envs.base import EnvRunner
from engine.errors import BackendError, ErrorClass, Stage
from engine.scheduler.reference import run_trajectory
from engine.trajectory import Status, StopReason, Trajectory
from engine.turn import TurnLimits
from tests.fakes import ScriptedBackend, ScriptedEnv

PROMPT = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


def reply(encoder, text: str, *, close: bool = True) -> list[int]:
    ids = encoder.tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids + [encoder.end_of_turn_id] if close else ids


def obs(text: str) -> dict:
    return {"role": "user", "content": text}


async def run(encoder, replies, env, *, max_new_tokens=64, **limits) -> tuple[Trajectory, ScriptedBackend]:
    backend = ScriptedBackend(replies) if not isinstance(replies, ScriptedBackend) else replies
    trajectory = Trajectory(prompt=list(PROMPT))
    sampling = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=encoder.stop_token_ids)
    await run_trajectory(
        trajectory, backend=backend, env=EnvRunner(env), encoder=encoder, sampling=sampling, limits=TurnLimits(**limits)
    )
    return trajectory, backend


def assert_masks(trajectory: Trajectory) -> None:
    """Loss mask 1 and real log-probs exactly on the model's tokens; 0 / 0.0 on everything else."""
    trajectory.check_invariant()
    model = set()
    for turn in trajectory.turns:
        model.update(range(turn.start, turn.start + turn.num_generated))
    for i in range(trajectory.response_length):
        assert trajectory.loss_mask[i] == (1 if i in model else 0)
        assert (trajectory.logprobs[i] == -0.5) if i in model else (trajectory.logprobs[i] == 0.0)


@pytest.mark.anyio
async def test_env_done_completes_with_the_env_reward(encoder):
    env = ScriptedEnv([obs("no"), obs("no"), obs("yes")], reward=1.0)
    trajectory, backend = await run(
        encoder, [reply(encoder, "3"), reply(encoder, "5"), reply(encoder, "4")], env, max_turns=8
    )
    assert (trajectory.status, trajectory.stop_reason) == (Status.COMPLETED, StopReason.ENV_DONE)
    assert trajectory.reward == 1.0 and len(trajectory.turns) == 3
    assert env.seen == ["3", "5", "4"]  # the env reads the text without the end-of-turn token
    assert env.num_resets == 1 and env.closed
    assert trajectory.turns[-1].num_observation == 0  # the final observation is not appended
    assert trajectory.weight_versions == ["v0"] * 3
    # each request sends the whole trajectory so far
    assert [len(r.input_ids) for r in backend.requests] == [
        trajectory.prompt_length + t.start for t in trajectory.turns
    ]
    assert_masks(trajectory)


@pytest.mark.anyio
async def test_max_turns_completes_and_the_env_still_judges_the_last_turn(encoder):
    env = ScriptedEnv([obs("wrong")], done_at_end=False)
    trajectory, _ = await run(encoder, [reply(encoder, str(i)) for i in range(3)], env, max_turns=3)
    assert (trajectory.status, trajectory.stop_reason) == (Status.COMPLETED, StopReason.MAX_TURNS)
    assert len(env.seen) == 3 and len(trajectory.turns) == 3
    assert trajectory.turns[-1].num_observation == 0
    assert_masks(trajectory)


@pytest.mark.anyio
async def test_token_budget_caps_each_turn_and_truncates(encoder):
    long = reply(encoder, " ".join(["word"] * 30), close=False)
    env = ScriptedEnv([obs("go on")], done_at_end=False)
    trajectory, backend = await run(encoder, [long] * 10, env, max_new_tokens=20, max_turns=10, max_tokens=70)
    assert (trajectory.status, trajectory.stop_reason) == (Status.TRUNCATED, StopReason.TOKEN_BUDGET)
    asked = [r.sampling_params.max_new_tokens for r in backend.requests]
    assert asked[0] == 20 and asked[-1] < 20  # the budget shrinks and caps the last request
    for turn, request in zip(trajectory.turns, backend.requests, strict=True):
        assert turn.num_generated <= request.sampling_params.max_new_tokens
    assert trajectory.response_length == 70
    assert_masks(trajectory)


@pytest.mark.anyio
async def test_an_observation_that_does_not_fit_the_budget_is_not_appended(encoder):
    env = ScriptedEnv([obs(" ".join(["long"] * 50))], done_at_end=False)
    trajectory, _ = await run(encoder, [reply(encoder, "7")], env, max_turns=5, max_tokens=30)
    assert trajectory.stop_reason is StopReason.TOKEN_BUDGET
    assert trajectory.response_length == trajectory.turns[0].num_generated == 2
    assert_masks(trajectory)


@pytest.mark.anyio
async def test_context_length_ends_with_length(encoder):
    env = ScriptedEnv([obs("again")], done_at_end=False)
    long = reply(encoder, " ".join(["word"] * 30), close=False)
    trajectory, _ = await run(encoder, [long] * 5, env, max_turns=5, max_context_len=40)
    assert (trajectory.status, trajectory.stop_reason) == (Status.TRUNCATED, StopReason.LENGTH)
    assert len(trajectory.tokens) == 40


@pytest.mark.anyio
async def test_env_exception_fails_the_trajectory_with_the_reason(encoder):
    env = ScriptedEnv([obs("ok"), RuntimeError("sandbox crashed")])
    trajectory, _ = await run(encoder, [reply(encoder, "1"), reply(encoder, "2")], env, max_turns=5)
    assert (trajectory.status, trajectory.stop_reason) == (Status.FAILED, StopReason.ENV_ERROR)
    [error] = trajectory.errors
    assert error.error_class is ErrorClass.ENV_EXCEPTION and error.stage is Stage.ENV and error.turn == 1  # the second
    assert "ScriptedEnv.step" in error.message and "sandbox crashed" in error.message
    assert env.closed
    assert_masks(trajectory)


@pytest.mark.anyio
async def test_backend_error_fails_only_its_trajectory(encoder):
    broken = ScriptedBackend(
        [reply(encoder, "1"), BackendError(ErrorClass.SERVER, "SGLang at http://x/generate: HTTP 503")]
    )
    healthy = ScriptedBackend([reply(encoder, "1"), reply(encoder, "4")])
    results = {}

    async def one(name, backend):
        results[name], _ = await run(encoder, backend, ScriptedEnv([obs("no"), obs("yes")]), max_turns=5)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "broken", broken)
        tg.start_soon(one, "healthy", healthy)
    assert (results["broken"].status, results["broken"].stop_reason) == (Status.FAILED, StopReason.BACKEND_ERROR)
    assert "HTTP 503" in results["broken"].errors[0].message
    assert results["healthy"].status is Status.COMPLETED
    assert_masks(results["broken"])


@pytest.mark.anyio
async def test_aborted_generation_ends_aborted(encoder):
    class AbortingBackend(ScriptedBackend):
        async def generate(self, *args, **kwargs):
            result = await super().generate(*args, **kwargs)
            return type(result)(**{**{s: getattr(result, s) for s in result.__slots__}, "finish_reason": "abort"})

    trajectory, _ = await run(
        encoder, AbortingBackend([reply(encoder, "partial", close=False)]), ScriptedEnv([obs("x")]), max_turns=5
    )
    assert (trajectory.status, trajectory.stop_reason) == (Status.ABORTED, StopReason.ABORTED)
    assert trajectory.turns[0].num_generated > 0  # the tokens generated before the abort are kept
    assert_masks(trajectory)


@pytest.mark.anyio
async def test_cancellation_ends_aborted_and_closes_the_env(encoder):
    started = anyio.Event()

    class HangingBackend(ScriptedBackend):
        async def generate(self, *args, **kwargs):
            started.set()
            await anyio.sleep_forever()

    env = ScriptedEnv([obs("x")])
    trajectory = Trajectory(prompt=list(PROMPT))
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: run_trajectory(
                trajectory, backend=HangingBackend([]), env=EnvRunner(env), encoder=encoder,
                sampling=SamplingParams(max_new_tokens=8), limits=TurnLimits(),
            )
        )  # fmt: skip
        await started.wait()
        tg.cancel_scope.cancel()
    assert (trajectory.status, trajectory.stop_reason) == (Status.ABORTED, StopReason.ABORTED)
    assert env.closed


def test_illegal_status_changes_are_refused():
    trajectory = Trajectory(prompt=[])
    with pytest.raises(ValueError, match="illegal status change pending -> completed"):
        trajectory.transition(Status.COMPLETED, StopReason.ENV_DONE)
    trajectory.transition(Status.RUNNING)
    with pytest.raises(ValueError, match="needs a stop reason"):
        trajectory.transition(Status.COMPLETED)
    trajectory.finish(StopReason.MAX_TURNS)
    with pytest.raises(ValueError, match="illegal status change"):
        trajectory.transition(Status.RUNNING)


@pytest.mark.anyio
async def test_a_prompt_that_fills_the_window_ends_with_length_before_any_request(encoder):
    env = ScriptedEnv([obs("x")])
    trajectory, backend = await run(encoder, [reply(encoder, "1")], env, max_context_len=5)
    assert (trajectory.status, trajectory.stop_reason) == (Status.TRUNCATED, StopReason.LENGTH)
    assert backend.requests == [] and trajectory.turns == [] and env.closed


class NotingBackend(ScriptedBackend):
    """Notes the input_ids each request was given, as given."""

    def __init__(self, replies):
        super().__init__(replies)
        self.given: list[object] = []

    async def generate(self, input_ids, *args, **kw):
        self.given.append(input_ids)
        return await super().generate(input_ids, *args, **kw)


class BufferBackend(NotingBackend):
    """Reads input_ids as an integer buffer."""

    token_buffers = True


@pytest.mark.anyio
async def test_a_backend_that_reads_token_buffers_gets_a_copy_of_the_trajectorys_array_and_others_a_list(encoder):
    """A copy: the request keeps the tokens it was sent while the trajectory grows (a body may still be built)."""
    replies = [reply(encoder, "3"), reply(encoder, "4")]
    trajectory, backend = await run(encoder, BufferBackend(replies), ScriptedEnv([obs("no"), obs("yes")]), max_turns=2)
    assert [type(ids) for ids in backend.given] == [type(trajectory.tokens)] * 2
    assert all(ids is not trajectory.tokens for ids in backend.given)
    assert [list(ids) for ids in backend.given] == [r.input_ids for r in backend.requests]
    assert len(backend.given[0]) == trajectory.prompt_length  # not grown by the turns after it
    _, plain = await run(encoder, NotingBackend(replies), ScriptedEnv([obs("no"), obs("yes")]), max_turns=2)
    assert [type(ids) for ids in plain.given] == [list] * 2
