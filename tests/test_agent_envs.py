"""Agent envs: an env that runs an agent program per sample against its own session of the engine's gateway.

The agents are real programs in real processes: tests/agents/program.py on the official `openai` SDK, and the
built-in python_agent env's program on the OpenAI Agents SDK with the python_tool sandbox. The policy is a
backend that answers through the real Qwen tokenizer and template, with a tool call until a tool has answered,
then text (so each sample's sampled tokens are known). Checked: the sample's prompt is the agent's first
request and its tokens the sampled ones, mask 1 exactly on them; the agent's info is the step's (its reward);
an agent that crashes, hangs or never asks fails its own trajectory only, within its error class's budget, and
every process it started is gone afterwards."""

from __future__ import annotations

import anyio
import openai
import psutil
import pytest

from engine.agents.env import AgentEnv, AgentHost, AgentRun
from engine.backends.base import GenerateResult
from engine.config import EngineConfig
from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine
from engine.envs.base import EnvRunner
from engine.envs.loader import EnvFactory
from engine.errors import ErrorClass
from engine.scheduler.retry import DEFAULT_PER_TURN, RetryPolicy
from engine.trajectory import Status
from tests.agents.weather_env import ProgramAgent
from tests.fakes import ScriptedBackend

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


class ToolThenAnswer(ScriptedBackend):
    """A tool call (`call`) until the conversation holds a tool's response, then `answer`."""

    def __init__(self, encoder: ChatEncoder, call: str, answer: str):
        super().__init__([])
        self.encoder, self.call, self.answer = encoder, call, answer

    async def generate(self, input_ids, sampling_params, image_data=None, *, rid=None, session_id=None):
        answered = "<tool_response>" in self.encoder.tokenizer.decode(input_ids)
        text = self.answer if answered else self.call
        ids = [*self.encoder.tokenizer(text, add_special_tokens=False)["input_ids"], self.encoder.end_of_turn_id]
        self.replies = [ids]
        return await super().generate(input_ids, sampling_params, image_data, rid=rid, session_id=session_id)


def engine_over(encoder, backend, build, rows, **config) -> RolloutEngine:
    settings = EngineConfig(
        n_samples_per_prompt=1, max_turns=8, max_new_tokens=128,
        retry=RetryPolicy(backoff_base_s=0.0, env_step_timeout_s=60), **config,
    )  # fmt: skip
    return RolloutEngine(backend=backend, encoder=encoder, env_factory=build, source=rows, config=settings)


def alive(pids: list[int]) -> list[int]:
    """The pids still running (a zombie has ended: it only waits to be reaped by a parent that is not ours)."""
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            continue
    return running


def task_rows(n: int) -> list[dict]:
    return [{"prompt": f"task {i}", "metadata": {"task": i}} for i in range(n)]


@pytest.mark.anyio
async def test_an_agent_program_is_its_samples_trajectory(encoder, tmp_path):
    backend = ToolThenAnswer(encoder, WEATHER_CALL, "It is sunny in Paris.")
    agent = ProgramAgent("finish", tmp_path)
    build = lambda sample: EnvRunner(agent)  # noqa: E731
    async with engine_over(encoder, backend, build, task_rows(1)) as engine:
        (group,) = await engine.rollout(1)
        gateway = AgentHost.of(engine.env_host).gateway
    (trajectory,) = group.trajectories
    assert trajectory.status is Status.COMPLETED, trajectory.errors
    assert trajectory.reward == 1.0  # the agent's info, as the env step's
    assert trajectory.prompt == [  # the agent's first request, not the prompt row
        {"role": "system", "content": "You answer questions about the weather."},
        {"role": "user", "content": "How is the weather in Paris?"},
    ]
    assert trajectory.metadata["tools"][0]["function"]["name"] == "get_weather"
    prompt = encoder.for_tools(trajectory.metadata["tools"]).encode_prompt(trajectory.prompt).token_ids
    assert trajectory.tokens[: trajectory.prompt_length].tolist() == list(prompt)
    sampled = [encoder.tokenizer.decode(trajectory.generated_ids(turn)) for turn in trajectory.turns]
    assert sampled == [WEATHER_CALL + "<|im_end|>", "It is sunny in Paris.<|im_end|>"]
    response, mask = list(trajectory.response_ids), list(trajectory.loss_mask)
    model = {i for t in trajectory.turns for i in range(t.start, t.start + t.num_generated)}
    assert [i for i, m in enumerate(mask) if m == 1] == sorted(model)
    assert "Sunny, 24 C." in encoder.tokenizer.decode(response)  # the tool's result, as an observation (mask 0)
    assert trajectory.forks == [] and gateway.counts["agent_exits:finished"] == 1
    assert alive(agent.pids()) == []  # what it left running, gone
    # the gateway closed its listener with the event loop's knowledge: the loop's next sockets work
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        stream = await anyio.connect_tcp("127.0.0.1", listener.extra(anyio.abc.SocketAttribute.local_port))
        await stream.aclose()


@pytest.mark.anyio
async def test_a_compacted_history_forks_a_chain_kept_beside_the_sample(encoder, tmp_path):
    backend = ToolThenAnswer(encoder, WEATHER_CALL, "It is sunny in Paris.")
    agent = ProgramAgent("compact", tmp_path)
    async with engine_over(encoder, backend, lambda sample: EnvRunner(agent), task_rows(1)) as engine:
        (group,) = await engine.rollout(1)
        summary, counts = engine.last_step_summary, AgentHost.of(engine.env_host).gateway.counts
    (trajectory,) = group.trajectories
    assert trajectory.status is Status.COMPLETED and len(trajectory.turns) == 2  # the sample: the main chain
    (fork,) = trajectory.forks
    assert fork.status is Status.COMPLETED and fork.metadata["fork_cause"] == "edited"
    assert "Anything else in Paris?" in fork.prompt[-1]["content"] and fork.num_generated > 0
    assert counts["forks:edited"] == 1
    assert summary["multi_turn/agent/forks"] == 1
    assert summary["multi_turn/agent/fork_tokens_untrained"] == fork.num_generated
    assert alive(agent.pids()) == []


class HeldFork(ScriptedBackend):
    """Answers every prompt with `answer`, but for a fork's (the compacted history's): that one it holds until
    it is aborted or cancelled (a long generation). `running` counts the generations under way."""

    def __init__(self, encoder: ChatEncoder, answer: str):
        super().__init__([])
        self.encoder, self.answer = encoder, answer
        self.running = 0
        self.holding, self.aborted = anyio.Event(), anyio.Event()

    async def generate(self, input_ids, sampling_params, image_data=None, **options):
        self.running += 1
        try:
            if "Anything else" in self.encoder.tokenizer.decode(input_ids):
                self.holding.set()
                await self.aborted.wait()
                return GenerateResult([], [], "", "abort", self.weight_version_, prompt_tokens=len(input_ids))
            ids = self.encoder.tokenizer(self.answer, add_special_tokens=False)["input_ids"]
            self.replies = [[*ids, self.encoder.end_of_turn_id]]
            return await super().generate(input_ids, sampling_params, image_data, **options)
        finally:
            self.running -= 1

    async def abort(self, rid=None) -> None:
        self.aborted.set()


class ForkThenExit(AgentEnv):
    """Asks once, then asks again with its history compacted (a fork of its session, whose generation the
    backend holds) and exits as soon as that generation runs, its request still open (in the test's `requests`).
    Its `aclose` is where a container would be ended."""

    timeout_s = 60.0
    close_timeout_s = 1.0  # the bound on its aclose (and so on its env's close)

    def __init__(self, backend: HeldFork, requests: anyio.abc.TaskGroup, *, hang_in_aclose: bool = False):
        self.backend, self.requests, self.hang_in_aclose = backend, requests, hang_in_aclose
        self.closed = False
        self.fork_error: Exception | None = None

    async def run(self, agent: AgentRun) -> dict:
        client = openai.AsyncOpenAI(base_url=agent.base_url, api_key=agent.api_key, max_retries=0)
        first = await client.chat.completions.create(model=agent.model, messages=PARIS)
        compacted = [
            PARIS[0],
            {"role": "user", "content": f"So far: {first.choices[0].message.content} Anything else?"},
        ]
        self.requests.start_soon(self._ask, client, compacted)
        await self.backend.holding.wait()
        return {"reward": 1.0}

    async def _ask(self, client: openai.AsyncOpenAI, messages: list[dict]) -> None:
        try:
            await client.chat.completions.create(model="policy", messages=messages)
        except openai.APIError as error:
            self.fork_error = error
        finally:
            await client.close()

    async def aclose(self) -> None:
        self.closed = True
        if self.hang_in_aclose:  # a container that will not stop
            await anyio.sleep_forever()


PARIS = [
    {"role": "system", "content": "You answer questions about the weather."},
    {"role": "user", "content": "How is the weather in Paris?"},
]


@pytest.mark.anyio
@pytest.mark.parametrize("hang_in_aclose", [False, True])
async def test_closing_an_agent_env_ends_its_running_forks_and_runs_its_aclose(encoder, hang_in_aclose):
    """The agent exits while a fork it made still generates: the env's close ends the fork at once (ABORTED, its
    open request an error) rather than waiting for it past the close's bound, and the env's `aclose` runs; an
    `aclose` that hangs is cut at its own bound (recorded on the sample) and the fork still ends."""
    backend = HeldFork(encoder, "It is sunny in Paris.")
    async with anyio.create_task_group() as requests:
        agent = ForkThenExit(backend, requests, hang_in_aclose=hang_in_aclose)
        async with engine_over(encoder, backend, lambda sample: EnvRunner(agent), task_rows(1)) as engine:
            with anyio.fail_after(30):
                (group,) = await engine.rollout(1)
            (trajectory,) = group.trajectories
            (fork,) = trajectory.forks
            assert trajectory.status is Status.COMPLETED and trajectory.reward == 1.0, trajectory.errors
            assert agent.closed  # the user's aclose ran
            cut = [e.message for e in trajectory.errors if "aclose still ran at its bound" in e.message]
            assert len(cut) == hang_in_aclose and len(trajectory.errors) == hang_in_aclose
            assert fork.status is Status.ABORTED and fork.metadata["fork_cause"] == "edited"
            assert backend.running == 0 and engine.scheduler.statistics().phases == {}  # nothing left running
            assert AgentHost.of(engine.env_host).gateway.sessions == {}
    assert isinstance(agent.fork_error, openai.APIStatusError) and agent.fork_error.status_code == 409


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("how", "outcome", "timeout_s"),
    [("crash", "crashed", 120.0), ("hang", "hung", 3.0), ("silent", "no_request", 120.0)],
)
async def test_an_agent_that_fails_fails_its_trajectory_alone_and_leaves_no_process(
    encoder, tmp_path, how, outcome, timeout_s
):
    backend = ToolThenAnswer(encoder, WEATHER_CALL, "It is sunny in Paris.")
    agents = {}

    def build(sample):
        index = sample.metadata["task"]
        ending, deadline = (how, timeout_s) if index == 0 else ("finish", 120.0)
        agents[index] = ProgramAgent(ending, tmp_path, timeout_s=deadline)
        return EnvRunner(agents[index])

    async with engine_over(encoder, backend, build, task_rows(3)) as engine:
        groups = await engine.rollout(3)
        counts = AgentHost.of(engine.env_host).gateway.counts
    by_task = {group.row["metadata"]["task"]: group.trajectories[0] for group in groups}
    failed = by_task.pop(0)
    assert failed.status is Status.FAILED
    (error,) = {e.error_class for e in failed.errors}
    assert error is ErrorClass.AGENT and outcome in failed.errors[-1].message
    if how == "crash":  # what the agent said, wherever it wrote it
        assert "the agent's tool server went away" in failed.errors[-1].message
    assert all(t.status is Status.COMPLETED and t.reward == 1.0 for t in by_task.values())  # the others go on
    # a retry starts a fresh agent only where none has seen a turn: before its first request
    attempts = 1 + DEFAULT_PER_TURN[ErrorClass.AGENT] if how == "silent" else 1
    assert counts[f"agent_exits:{outcome}"] == attempts and len(agents[0].pid_files) == attempts
    assert counts["agent_exits:finished"] == 2
    pids = [pid for agent in agents.values() for pid in agent.pids()]
    assert len(pids) == 3 * (attempts + 2) and alive(pids) == []


@pytest.mark.anyio
async def test_the_built_in_python_agent_solves_a_task_with_the_sandbox(encoder):
    """An OpenAI Agents SDK program whose tool runs the code in the python_tool sandbox; the checker judges."""
    pytest.importorskip("agents", reason="the built-in python_agent env needs openai-agents (turnstile[agents])")
    code_call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
    backend = ToolThenAnswer(encoder, code_call, "<answer>42</answer>")
    row = {
        "prompt": [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "What is six times seven?"}],
        "metadata": {"checker": {"kind": "number", "value": 42}},
    }
    async with engine_over(encoder, backend, EnvFactory("engine.envs.python_agent"), [row]) as engine:
        (group,) = await engine.rollout(1)
    (trajectory,) = group.trajectories
    assert trajectory.status is Status.COMPLETED, trajectory.errors
    assert trajectory.reward == 1.0
    assert [t["function"]["name"] for t in trajectory.metadata["tools"]] == ["python"]
    text = encoder.tokenizer.decode(trajectory.response_ids)
    assert "42" in text.split("<tool_response>")[1]  # the sandbox ran the model's code
    assert len(trajectory.turns) == 2


# -- under slime ------------------------------------------------------------------------------------------


def test_slimes_generate_rollout_runs_an_agent_env_unchanged(encoder):
    """`rollout_interaction_env_path` names an agent env module: groups, rewards and samples as for any env."""
    from tests.test_slime_rollout import run, samples_of, slime_args

    args = slime_args(
        rollout_interaction_env_path="tests.agents.weather_env", max_turns=4, turnstile={"max_new_tokens": 64}
    )
    backend = ToolThenAnswer(encoder, WEATHER_CALL, "It is sunny in Paris.")
    outs, source = run(args, steps=2, backend=backend)
    call = encoder.tokenizer(WEATHER_CALL, add_special_tokens=False)["input_ids"]
    answer = encoder.tokenizer("It is sunny in Paris.", add_special_tokens=False)["input_ids"]
    for out in outs:
        assert [len(group) for group in out.samples] == [2, 2]  # whole groups, slime's shape
        for sample in samples_of(out):
            assert sample.status == sample.Status.COMPLETED and sample.reward == 1.0  # the agent's info
            assert sum(sample.loss_mask) == len(call) + len(answer) + 2  # the sampled turns, each with <|im_end|>
            assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
            prompt = encoder.tokenizer.decode(sample.tokens[: len(sample.tokens) - sample.response_length])
            assert "How is the weather in Paris?" in prompt and "get_weather" in prompt  # the agent's request
    assert source.handed_out == [0, 1, 2, 3]


def test_slimes_custom_generate_function_runs_an_agent_env(encoder):
    import anyio

    from bridge.convert import sample_class
    from bridge.service import RolloutService
    from bridge.settings import settings_from_args
    from bridge.slime import SERVICE_ATTRIBUTE, generate
    from tests.test_slime_rollout import slime_args

    args = slime_args(
        rollout_interaction_env_path="tests.agents.weather_env", max_turns=4, n_samples_per_prompt=1,
        turnstile={"max_new_tokens": 64},
    )  # fmt: skip
    backend = ToolThenAnswer(encoder, WEATHER_CALL, "It is sunny in Paris.")
    setattr(args, SERVICE_ATTRIBUTE, RolloutService(settings_from_args(args), env_args=args, backend=backend))
    Sample = sample_class()

    async def main():
        return await generate(args, Sample(index=0, prompt="the weather"), {"temperature": 1.0, "max_new_tokens": 64})

    try:
        sample = anyio.run(main)
    finally:
        getattr(args, SERVICE_ATTRIBUTE).shutdown()
    assert sample.status == Sample.Status.COMPLETED and sample.metadata["num_turns"] == 2
    assert sample.reward == 1.0 and len(sample.loss_mask) == sample.response_length


AGENT_SCRIPT = """
import os, sys, openai
prompt, base_url = sys.argv[1], sys.argv[2]
assert prompt == os.environ["TURNSTILE_PROMPT"] and base_url == os.environ["OPENAI_BASE_URL"], (sys.argv, os.environ)
reply = openai.OpenAI(max_retries=0).chat.completions.create(
    model=os.environ["TURNSTILE_MODEL"], messages=[{"role": "user", "content": prompt}]
)
open("answer.txt", "w").write(reply.choices[0].message.content or "(empty)")
"""
REWARD_SCRIPT = """
import os
print("judging", os.environ["TURNSTILE_AGENT_OUTPUT"])
print(1.0 if os.path.exists("answer.txt") else 0.0)
"""


def test_an_agent_command_runs_per_sample_with_its_placeholders_and_a_reward_command(tmp_path):
    """`turnstile run --agent-command` (the agent_command env) on the embedded default: the command per sample, in
    a working directory of its own, `{prompt}` and `{openai_base_url}` filled, its session's URLs and key in its
    environment; `--agent-reward-command` run after it there, its last line the reward."""
    import subprocess
    import sys

    from tests.test_cli import read_lines

    (tmp_path / "agent.py").write_text(AGENT_SCRIPT)
    (tmp_path / "judge.py").write_text(REWARD_SCRIPT)
    out = tmp_path / "out.jsonl"
    argv = [
        sys.executable, "-m", "engine.cli", "run", "--num-prompts", "2", "--out", str(out),
        "--agent-command", f"{sys.executable} {tmp_path / 'agent.py'} {{prompt}} {{openai_base_url}}",
        "--agent-reward-command", f"{sys.executable} {tmp_path / 'judge.py'}",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_lines(out)
    assert [(r["status"], r["reward"]) for r in records] == [("completed", 1.0), ("completed", 1.0)], records
    assert all(r["prompt_text"].endswith("<|im_start|>assistant\n") for r in records)  # the agent's request


def test_an_agent_command_under_slime_is_a_top_level_key_or_one_of_the_turnstile_section():
    """slime sets each top-level key of its custom config on its args (slime/utils/arguments.py at 624b824), which
    envs are built with: `agent_command:` there, with `rollout_interaction_env_path: agent_command`; or
    `turnstile: {agent_command: ...}`, which alone makes the env agent_command, and with another env is refused."""
    from types import SimpleNamespace

    from bridge.settings import settings_from_args
    from engine.envs.agent_command import build_env
    from engine.envs.loader import EnvSample

    sample = EnvSample(prompt=[{"role": "user", "content": "Fix the bug."}])
    top = SimpleNamespace(rollout_interaction_env_path="agent_command", agent_command="claude -p {prompt}")
    assert settings_from_args(top).env_path == "engine.envs.agent_command"
    assert (build_env(sample, top).command, build_env(sample, top).prompt) == (
        ["claude", "-p", "{prompt}"],
        "Fix the bug.",
    )
    section = SimpleNamespace(turnstile={"agent_command": "codex exec {prompt}"})
    assert settings_from_args(section).env_path == "engine.envs.agent_command"
    assert build_env(sample, section).command == ["codex", "exec", "{prompt}"]
    other = SimpleNamespace(rollout_interaction_env_path="python_tool", turnstile={"agent_command": "codex exec"})
    with pytest.raises(ValueError, match="agent_command runs the agent_command env, but env_path names"):
        settings_from_args(other)
