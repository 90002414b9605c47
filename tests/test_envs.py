"""Envs: the loader (module and file paths, one clear error per bad input), the runner (worker
thread, timeout, error classes), and the built-in arithmetic env in text and vision mode."""

from __future__ import annotations

import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest
from PIL import Image

from engine.envs import arith
from engine.envs.base import AbandonedCalls, AsyncInteractionEnv, BaseInteractionEnv, EnvRunner
from engine.envs.loader import EnvFactory, EnvLoadError, EnvSample, load_env_module
from engine.errors import EnvError, EnvRetryableError, ErrorClass

REPO = Path(__file__).resolve().parents[1]
SLIME_STYLE_FILE = REPO / "tests" / "envs" / "slime_style_env.py"
ARGS = SimpleNamespace(max_turns=3)


def write_module(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


# -- loader errors: one EnvLoadError naming the module and the cause ----------------------------


def test_dotted_path_that_does_not_import():
    with pytest.raises(EnvLoadError, match=r"'no_such_pkg_7f\.env' does not import: ModuleNotFoundError"):
        load_env_module("no_such_pkg_7f.env")


def test_file_that_raises_on_import(tmp_path):
    path = write_module(tmp_path, "broken", "raise RuntimeError('no sandbox here')\n")
    with pytest.raises(EnvLoadError, match=r"broken\.py' does not import: RuntimeError\('no sandbox here'\)"):
        load_env_module(path)


def test_file_with_a_syntax_error(tmp_path):
    path = write_module(tmp_path, "typo", "def build_env(:\n")
    with pytest.raises(EnvLoadError, match=r"typo\.py' does not import: SyntaxError"):
        load_env_module(path)


def test_py_path_that_does_not_exist(tmp_path):
    with pytest.raises(EnvLoadError, match=r"missing_env\.py' does not exist"):
        load_env_module(str(tmp_path / "missing_env.py"))


def test_module_without_build_env(tmp_path):
    path = write_module(tmp_path, "no_build", "X = 1\n")
    with pytest.raises(EnvLoadError, match=r"no_build\.py' has no build_env"):
        EnvFactory(path)


def test_build_env_not_callable(tmp_path):
    path = write_module(tmp_path, "not_callable", "build_env = 3\n")
    with pytest.raises(EnvLoadError, match=r"not_callable\.py': build_env is a int, not callable"):
        EnvFactory(path)


def test_build_env_raising_names_module_and_exception(tmp_path):
    path = write_module(tmp_path, "raising", "def build_env(sample=None, args=None):\n    raise KeyError('label')\n")
    factory = EnvFactory(path)
    with pytest.raises(EnvLoadError, match=r"raising\.py': build_env raised KeyError\('label'\)") as caught:
        factory(EnvSample())
    assert isinstance(caught.value.__cause__, KeyError)


def test_build_env_returning_something_without_step(tmp_path):
    path = write_module(tmp_path, "stepless", "def build_env(sample=None, args=None):\n    return object()\n")
    with pytest.raises(EnvLoadError, match=r"stepless\.py': build_env returned object, which has no step"):
        EnvFactory(path)(EnvSample())


def test_load_error_is_a_value_error():
    assert issubclass(EnvLoadError, ValueError)


# -- loading a slime-shaped module unchanged -------------------------------------------------------


async def play(runner: EnvRunner, responses: list[str]) -> list[tuple[dict, bool, dict]]:
    """Step through `responses` until done; returns (chat message, done, info) per step."""
    await runner.reset()
    results = []
    for response in responses:
        result = await runner.step(response)
        results.append((runner.message(result.observation), result.done, result.info))
        if result.done:
            break
    return results


@pytest.fixture(params=["file", "module"])
def slime_style_path(request, monkeypatch) -> str:
    if request.param == "file":
        return str(SLIME_STYLE_FILE)
    monkeypatch.syspath_prepend(str(REPO))
    return "tests.envs.slime_style_env"


@pytest.mark.anyio
async def test_slime_style_env_loads_and_formats_with_module_function(slime_style_path):
    factory = EnvFactory(slime_style_path, args=ARGS, step_timeout=5.0)
    runner = factory(EnvSample(prompt="guess", label="42"))
    assert runner.step_timeout == 5.0
    results = await play(runner, ["7", "42"])
    assert results == [
        ({"role": "tool", "content": "turn 1: wrong"}, False, {"score": 0.0}),
        ({"role": "tool", "content": "turn 2: correct"}, True, {"score": 1.0}),
    ]
    results = await play(factory(EnvSample(label="42")), ["1", "2", "3", "4"])
    assert [done for _, done, _ in results] == [False, False, True]  # args.max_turns == 3


def test_slime_style_env_without_max_turns_fails_to_build():
    factory = EnvFactory(str(SLIME_STYLE_FILE), args=SimpleNamespace(max_turns=None))
    with pytest.raises(EnvLoadError, match=r"slime_style_env\.py': build_env raised ValueError\('max_turns"):
        factory(EnvSample(label="1"))


def test_same_file_loads_once():
    assert load_env_module(str(SLIME_STYLE_FILE)) is load_env_module(str(SLIME_STYLE_FILE))


def test_positional_only_build_env(tmp_path):
    source = """
        class Env:
            def __init__(self, label): self.label = label
            def step(self, text): return {}, True, {}
        def build_env(sample, args, /): return Env(sample.label)
    """
    runner = EnvFactory(write_module(tmp_path, "positional", source))(EnvSample(label="x"))
    assert runner.env.label == "x"


def test_format_observation_order(tmp_path):
    source = """
        from engine.envs.base import BaseInteractionEnv
        class Inherits(BaseInteractionEnv):
            def step(self, text): return {}, True, {}
        class Own(Inherits):
            def format_observation(self, observation): return {"role": "user", "content": "own"}
        def build_env(sample=None, args=None): return Own() if sample.label == "own" else Inherits()
        def format_observation(observation): return {"role": "tool", "content": "module"}
    """
    factory = EnvFactory(write_module(tmp_path, "formats", source))
    assert factory(EnvSample(label="own")).message({})["content"] == "own"
    assert factory(EnvSample(label="inherits")).message({})["content"] == "module"
    runner = EnvFactory("engine.envs.arith")(None)  # no module-level format_observation: the default
    assert runner.message({"obs_str": "hi"}) == {"role": "user", "content": [{"type": "text", "text": "hi"}]}


# -- EnvRunner -------------------------------------------------------------------------------------


class HandFiredTimeouts:
    """An EnvRunner's `deadlines` whose timeouts the test fires: each call's scope, to cancel when it likes."""

    def __init__(self):
        self.scopes: list[anyio.CancelScope] = []

    def after(self, seconds: float) -> anyio.CancelScope:
        self.scopes.append(scope := anyio.CancelScope())
        return scope


class BlockingEnv:
    """A sync step that waits on an event someone else sets."""

    def __init__(self):
        self.started, self.release, self.closed = threading.Event(), threading.Event(), threading.Event()
        self.step_thread: int | None = None
        self.close_thread: int | None = None

    def step(self, text):
        self.step_thread = threading.get_ident()
        self.started.set()
        if not self.release.wait(timeout=10):
            raise AssertionError("never released")
        return {"obs_str": "released"}, True, {}

    def close(self):
        self.close_thread = threading.get_ident()
        self.closed.set()


@pytest.mark.anyio
async def test_blocking_sync_step_runs_in_a_worker_thread():
    env = BlockingEnv()
    runner = EnvRunner(env)
    results = []

    async def step():
        results.append(await runner.step("x"))

    async def release_once_waiting():
        await anyio.to_thread.run_sync(env.started.wait, 10)
        env.release.set()  # the event loop is free while the step blocks

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(step)
            tg.start_soon(release_once_waiting)
    assert results[0].observation == {"obs_str": "released"}
    assert env.step_thread != threading.get_ident()


@pytest.mark.anyio
async def test_step_past_timeout_is_env_timeout():
    env = BlockingEnv()
    runner = EnvRunner(env, step_timeout=0.05)
    try:
        with pytest.raises(EnvError) as caught:
            await runner.step("x")
    finally:
        env.release.set()
    assert caught.value.error_class is ErrorClass.ENV_TIMEOUT
    assert "BlockingEnv.step timed out after 0.05s" in caught.value.message
    assert caught.value.retryable


@pytest.mark.anyio
async def test_a_runner_whose_timed_out_step_still_runs_refuses_to_call_the_env_again():
    env, timeouts, left = BlockingEnv(), HandFiredTimeouts(), AbandonedCalls()
    runner = EnvRunner(env, step_timeout=30.0)
    runner.deadlines, runner.abandoned_calls = timeouts, left

    async def times_out() -> None:
        with pytest.raises(EnvError, match="timed out"):
            await runner.step("x")

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(times_out)
                await anyio.to_thread.run_sync(env.started.wait, 10)  # the step runs in its thread
                timeouts.scopes[-1].cancel()  # and its time is up
        assert runner.is_busy  # the abandoned thread is still touching the env
        first_thread = env.step_thread
        with pytest.raises(EnvError, match="an earlier call that timed out is still running") as caught:
            await runner.step("x")
        assert caught.value.error_class is ErrorClass.ENV_EXCEPTION and env.step_thread == first_thread
        with anyio.fail_after(1):  # closing does not wait for the abandoned call
            await runner.close()
        assert runner.is_busy and not env.closed.is_set()  # nor closes the env under it
        assert len(left) == 1 and left.describe().startswith("BlockingEnv.step (running ")
    finally:
        env.release.set()
    assert await anyio.to_thread.run_sync(left.wait, 10) and len(left) == 0  # returned, its env closed first
    assert env.closed.is_set() and env.close_thread == first_thread and not runner.is_busy


@pytest.mark.anyio
async def test_a_step_that_timed_out_waiting_for_a_thread_never_runs_and_leaves_its_env_free():
    """All env threads busy: a step's timeout passes before it gets one. That call never runs, so its env is
    not busy, and closing it does not wait for a call that will never return (a thread left waiting on it
    kept the process from exiting)."""
    limiter, busy = anyio.CapacityLimiter(1), BlockingEnv()
    waiting = BlockingEnv()
    runner = EnvRunner(waiting, step_timeout=0.05, limiter=limiter)
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(EnvRunner(busy, limiter=limiter).step, "x")
                await anyio.to_thread.run_sync(busy.started.wait, 10)  # the one thread is taken
                with pytest.raises(EnvError) as caught:
                    await runner.step("y")
                assert caught.value.error_class is ErrorClass.ENV_TIMEOUT
                assert not runner.is_busy
                busy.release.set()
            waiting.release.set()
            result = await runner.step("z")  # called again as it is: nothing else touches it
            await runner.close()
    finally:
        busy.release.set()
        waiting.release.set()
    assert result.observation == {"obs_str": "released"} and waiting.started.is_set()


@pytest.mark.anyio
async def test_a_timeout_error_raised_by_the_env_itself_is_an_exception_not_our_timeout():
    with pytest.raises(EnvError) as caught:
        await EnvRunner(RaisingEnv(TimeoutError("socket read timed out")), step_timeout=30).step("x")
    assert caught.value.error_class is ErrorClass.ENV_EXCEPTION
    assert "socket read timed out" in caught.value.message


@pytest.mark.anyio
async def test_reset_runs_under_the_step_timeout():
    class HangingReset(BlockingEnv):
        def reset(self):
            self.release.wait(timeout=10)
            return {}, {}

    env = HangingReset()
    try:
        with pytest.raises(EnvError) as caught:
            await EnvRunner(env, step_timeout=0.05).reset()
    finally:
        env.release.set()
    assert caught.value.error_class is ErrorClass.ENV_TIMEOUT and "HangingReset.reset timed out" in caught.value.message


@pytest.mark.anyio
async def test_sync_steps_use_the_given_thread_limiter():
    limiter = anyio.CapacityLimiter(1)
    seen = []

    class Probe(BaseInteractionEnv):
        def step(self, text):
            seen.append(limiter.borrowed_tokens)
            return {}, True, {}

    await EnvRunner(Probe(), limiter=limiter).step("x")
    assert seen == [1]


class RaisingEnv(BaseInteractionEnv):
    def __init__(self, exc: Exception):
        self.exc = exc

    def step(self, text):
        raise self.exc


class HelperRaisingEnv(BaseInteractionEnv):
    def step(self, text):
        return self._grade(text)

    def _grade(self, text):
        raise ValueError(f"my bug: {text}")


@pytest.mark.anyio
@pytest.mark.parametrize("is_async", [False, True])
async def test_an_env_exception_keeps_the_envs_own_frames_as_its_traceback(is_async):
    env = AsyncHelperRaisingEnv() if is_async else HelperRaisingEnv()
    with pytest.raises(EnvError) as caught:
        await EnvRunner(env).step("x")
    record = caught.value.noted("retry budget spent").record(0)  # through a noted copy, as the scheduler keeps it
    lines = record.traceback.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and lines[-1] == "ValueError: my bug: x"
    files = [line.split('"')[1] for line in lines if line.startswith('  File "')]
    assert set(files) == {__file__}  # the env's frames; none of the engine's, anyio's or the standard library's
    assert (", in astep\n" if is_async else ", in step\n") in record.traceback and ", in _grade\n" in record.traceback


class AsyncHelperRaisingEnv(HelperRaisingEnv):
    async def astep(self, text):
        return self._grade(text)


def test_an_error_with_no_exception_behind_it_has_no_traceback():
    assert EnvError(ErrorClass.ENV_TIMEOUT, "env X.step timed out after 2s").record(3).traceback is None


@pytest.mark.anyio
async def test_env_retryable_error_is_env_retryable():
    with pytest.raises(EnvError) as caught:
        await EnvRunner(RaisingEnv(EnvRetryableError("sandbox busy"))).step("x")
    assert caught.value.error_class is ErrorClass.ENV_RETRYABLE
    assert "RaisingEnv.step" in caught.value.message and "sandbox busy" in caught.value.message


@pytest.mark.anyio
async def test_other_exception_is_env_exception_naming_env_and_exception():
    with pytest.raises(EnvError) as caught:
        await EnvRunner(RaisingEnv(ZeroDivisionError("bad reward")), name="geo3k").step("x")
    assert caught.value.error_class is ErrorClass.ENV_EXCEPTION
    assert caught.value.message == "env geo3k.step raised ZeroDivisionError('bad reward')"
    assert not caught.value.retryable


class ShapeEnv(BaseInteractionEnv):
    def __init__(self, result):
        self.result = result

    def step(self, text):
        return self.result


@pytest.mark.anyio
@pytest.mark.parametrize("result", ["just text", ({}, True), (["obs"], True, {}), None])
async def test_wrong_return_shape_is_env_exception(result):
    with pytest.raises(EnvError) as caught:
        await EnvRunner(ShapeEnv(result)).step("x")
    assert caught.value.error_class is ErrorClass.ENV_EXCEPTION
    assert "ShapeEnv.step returned" in caught.value.message and "expected (observation" in caught.value.message


@pytest.mark.anyio
async def test_async_env_runs_without_threads(monkeypatch):
    class Remote(AsyncInteractionEnv):
        async def astep(self, text):
            return {"obs_str": f"echo {text}"}, False, {"thread": threading.get_ident()}

    def no_threads(*args, **kwargs):
        raise AssertionError("an async env must not use a worker thread")

    monkeypatch.setattr(anyio.to_thread, "run_sync", no_threads)
    runner = EnvRunner(Remote())
    assert await runner.reset() == {}
    result = await runner.step("hi")
    assert result.observation == {"obs_str": "echo hi"} and result.info["thread"] == threading.get_ident()
    await runner.close()


@pytest.mark.parametrize(
    ("formatter", "expected"),
    [
        (lambda obs: obs["missing"], "format_observation raised KeyError('missing')"),
        (lambda obs: "plain text", "format_observation returned 'plain text', expected a chat message dict"),
        (lambda obs: {"role": "user"}, "format_observation returned {'role': 'user'}"),
    ],
)
def test_format_observation_failures(formatter, expected):
    runner = EnvRunner(ShapeEnv(None), format_observation=formatter)
    with pytest.raises(EnvError) as caught:
        runner.message({})
    assert caught.value.error_class is ErrorClass.ENV_EXCEPTION
    assert f"env ShapeEnv.{expected}" in caught.value.message


# -- the built-in arithmetic env -----------------------------------------------------------------


def test_make_prompts_is_deterministic_and_labels_are_right():
    rows = arith.make_prompts(20, seed=3)
    assert rows == arith.make_prompts(20, seed=3) and rows != arith.make_prompts(20, seed=4)
    for row in rows:
        a, op, b = row["metadata"]["question"].split()
        assert row["label"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))
        assert row["prompt"] == [{"role": "user", "content": f"What is {a} {op} {b}? Answer with a number."}]


def arith_runner(row: dict, max_turns: int = 3) -> EnvRunner:
    return EnvFactory("engine.envs.arith", args=SimpleNamespace(max_turns=max_turns))(EnvSample.from_row(row))


@pytest.mark.anyio
async def test_arith_correct_answer_ends_with_reward_1():
    row = arith.make_prompts(1, seed=0)[0]
    results = await play(arith_runner(row), [f"I think 3, no: {row['label']}"])
    assert [(done, info["reward"]) for _, done, info in results] == [(True, 1.0)]


@pytest.mark.anyio
async def test_arith_wrong_answer_gets_feedback_then_correct():
    row = arith.make_prompts(1, seed=0)[0]
    wrong = str(int(row["label"]) + 1)
    results = await play(arith_runner(row), [wrong, "no idea", row["label"]])
    question = row["metadata"]["question"]
    assert [message["content"][-1]["text"] for message, _, _ in results[:2]] == [
        f"{wrong} is not right, try again. What is {question}?",
        f"No number found, try again. What is {question}?",
    ]
    assert [done for _, done, _ in results] == [False, False, True]
    assert "reward" not in results[0][2] and results[2][2]["reward"] == 1.0


@pytest.mark.anyio
async def test_arith_turn_limit_ends_with_reward_0():
    row = arith.make_prompts(1, seed=0)[0]
    wrong = [int(row["label"]) + k for k in range(1, 6)]
    results = await play(arith_runner(row, max_turns=4), [f"maybe {n}" for n in wrong])
    assert [done for _, done, _ in results] == [False, False, False, True]
    assert results[-1][2] == {"attempts": 4, "guess": wrong[3], "reward": 0.0}


@pytest.mark.anyio
async def test_arith_vision_mode_puts_images_in_prompt_and_feedback():
    row = arith.make_prompts(2, seed=1, vision=True)[0]
    image_part, text_part = row["prompt"][0]["content"]
    assert isinstance(image_part["image"], Image.Image) and image_part["image"].size == arith.IMAGE_SIZE
    assert text_part["text"].startswith("What is ") and row["metadata"]["vision"] is True
    assert row == arith.make_prompts(2, seed=1, vision=True)[0]  # images compare by pixels

    runner = arith_runner(row)
    await runner.reset()
    result = await runner.step("0")
    [image] = result.observation["multi_modal_data"]["image"]
    message = runner.message(result.observation)
    assert message["content"][0] == {"type": "image", "image": image}
    assert message["content"][1]["type"] == "text"
    assert image.tobytes() == image_part["image"].tobytes()


def test_arith_build_env_without_sample_and_with_a_bad_one():
    env = arith.build_env()
    assert env.answer == int(arith.make_prompts(1)[0]["label"]) and env.max_attempts == arith.DEFAULT_MAX_ATTEMPTS
    other = arith.build_env(EnvSample(prompt="prompt-7"))  # not one of make_prompts' rows
    again = arith.build_env(EnvSample(prompt="prompt-7"))
    assert (other.question, other.answer) == (again.question, again.answer)  # derived from the prompt
    observation, done, _ = other.step("no idea")
    assert not done and other.question in observation["obs_str"]
    with pytest.raises(ValueError, match="needs an integer sample.label"):
        arith.build_env(EnvSample(label="seven", metadata={"question": "3 + 4"}))
