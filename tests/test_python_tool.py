"""The python tool env: its sandbox holds hostile code and says so, its episodes are judged by the task's
checker, a rollout goes on around a hostile trajectory, and `turnstile run --env python_tool` runs end to
end on the embedded default and against a real SGLang server."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest

from engine.encoding import ChatEncoder
from engine.engine import EngineConfig, RolloutEngine
from engine.envs.loader import EnvFactory, EnvSample
from engine.envs.python_tool import (
    PYTHON_TOOL,
    TASKS,
    NumberAnswer,
    SandboxLimits,
    build_env,
    isolation,
    make_prompts,
    run_python,
)
from engine.envs.python_tool.cgroups import CallGroup, cgroup_parent
from engine.envs.python_tool.sandbox import Tool
from engine.envs.python_tool.tasks import TASKS_BY_ID
from engine.scheduler.retry import RetryPolicy
from engine.trajectory import Status
from engine.turn import TurnLimits

pytestmark = pytest.mark.anyio

FAST = SandboxLimits(wall_seconds=3, cpu_seconds=2)
SECRET = "turnstile-test-secret-4f1d"


def tool_call(code: str) -> str:
    return f"Let me compute.\n<tool_call>\n{json.dumps({'name': 'python', 'arguments': {'code': code}})}\n</tool_call>"


def needs(what: str, available: bool):
    """Skip, saying why, where this kernel does not let the sandbox enforce `what`."""
    if not available:
        pytest.skip(f"this machine does not let the sandbox enforce {what}: {isolation().not_enforced()}")


# -- the sandbox against hostile code: each contained, reported, and the parent unharmed -------------


async def test_a_plain_program_runs_and_its_output_comes_back():
    result = await run_python("import sys\nprint(6 * 7)\nprint('oops', file=sys.stderr)\nsys.exit(3)", FAST)
    assert (result.exit_code, result.stdout, result.stderr) == (3, "42\n", "oops\n")
    assert result.observation() == "exit status 3\n--- stdout ---\n42\n--- stderr ---\noops"


async def test_an_exception_shows_the_codes_own_traceback():
    result = await run_python("def f():\n    return 1 / 0\nf()", FAST)
    assert result.exit_code == 1
    assert 'File "main.py", line 2, in f' in result.stderr and "ZeroDivisionError" in result.stderr
    assert "child" not in result.stderr  # the sandbox's own frames are not shown


async def test_an_infinite_loop_is_killed_at_the_cpu_time_limit():
    with anyio.fail_after(30):
        result = await run_python("while True:\n    pass", SandboxLimits(wall_seconds=20, cpu_seconds=1))
    assert result.limits_hit == ("cpu_time",) and result.signal in ("SIGXCPU", "SIGKILL")
    assert "killed: the CPU time limit of 1 s was reached" in result.observation()


async def test_a_sleeping_program_is_killed_with_the_children_it_left_behind():
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\ntime.sleep(60)"
    with anyio.fail_after(FAST.wall_seconds + 5):
        result = await run_python(code, FAST)
    assert result.limits_hit == ("wall_time",)
    assert "killed: the wall-clock limit of 3 s was reached" in result.observation()


async def test_a_fork_bomb_hits_the_process_limit():
    needs("the process limit", isolation().own_user)
    with anyio.fail_after(FAST.wall_seconds + 10):
        result = await run_python("import os\nwhile True:\n    os.fork()", SandboxLimits(wall_seconds=3, processes=8))
    assert "processes" in result.limits_hit or "wall_time" in result.limits_hit
    if "processes" in result.limits_hit:
        assert "the process limit of 8 was reached" in result.observation()
    assert await _still_forks()  # the machine is not starved of processes afterwards


async def test_a_call_cancelled_while_it_runs_leaves_no_control_group(monkeypatch):
    found = isolation()
    needs("a control group per call", found.tool is Tool.BUBBLEWRAP and found.cgroup is not None)
    joined, groups = anyio.Event(), []
    join = CallGroup.join

    def joined_then_said(group: CallGroup, pid: int) -> None:  # run in a worker thread
        join(group, pid)
        groups.append(group)
        anyio.from_thread.run_sync(joined.set)

    monkeypatch.setattr(CallGroup, "join", joined_then_said)
    with anyio.fail_after(FAST.wall_seconds + 10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(run_python, "import time\ntime.sleep(60)", FAST)
            await joined.wait()
            tasks.cancel_scope.cancel()
    [group] = groups
    left = [directory for directory in group.directories if directory.exists()]
    group.remove()  # where the test fails, not left on the machine
    assert not left


async def test_a_group_whose_call_is_cancelled_while_it_closes_is_still_removed(monkeypatch):
    """The first kill finds a process still exiting (one freeing much memory takes a while), so closing waits;
    the call is cancelled then. The group is removed all the same, within its own deadline."""
    parent = cgroup_parent()
    needs("a control group per call", parent is not None)
    group = CallGroup.create(parent, memory_bytes=64 << 20, processes=4)
    process = await anyio.open_process(["sleep", "60"])
    try:
        group.join(process.pid)
        waiting = anyio.Event()
        kill = CallGroup.kill

        def still_exiting_at_first(group: CallGroup) -> None:
            if not waiting.is_set():
                waiting.set()
                return
            kill(group)

        monkeypatch.setattr(CallGroup, "kill", still_exiting_at_first)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(group.close)
                await waiting.wait()  # close() is waiting for the process to go
                tasks.cancel_scope.cancel()
        assert not any(directory.exists() for directory in group.directories)
    finally:  # the process is gone already where close() did its work
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        group.remove()


async def _still_forks() -> bool:
    return (
        await run_python("import os\npid = os.fork()\nos._exit(0) if pid == 0 else print(os.waitpid(pid, 0)[1])")
    ).ok


async def test_a_memory_hog_gets_a_memory_error():
    result = await run_python("hog = bytearray(4 << 30)", FAST)
    assert result.exit_code == 1 and "memory" in result.limits_hit
    assert "the memory limit of 512 MiB was reached" in result.observation()


async def test_huge_output_is_cut_off_and_truncated_with_a_marker():
    code = "import sys\nwhile True:\n    sys.stdout.write('spam ' * 2000)"
    with anyio.fail_after(FAST.wall_seconds + 5):
        result = await run_python(code, SandboxLimits(wall_seconds=3, output_bytes=100_000, shown_chars=400))
    assert "output" in result.limits_hit and result.stdout_bytes > 100_000
    observation = result.observation()
    assert "killed: the output limit of 100000 bytes was exceeded" in observation
    assert "bytes not shown ...]" in observation and len(observation) < 1000


async def test_a_long_stream_keeps_its_head_and_tail():
    result = await run_python("for i in range(5000):\n    print(i)", SandboxLimits(shown_chars=200))
    assert result.ok and result.stdout.startswith("0\n1\n2\n") and result.stdout.rstrip().endswith("4999")
    assert "bytes not shown ...]" in result.stdout


async def test_writes_outside_the_scratch_directory_are_refused(tmp_path):
    needs("file-system confinement (Landlock, or an unprivileged user)", isolation().landlock_abi > 0)
    target = tmp_path / "escaped.txt"
    os.chmod(tmp_path, 0o777)  # even a folder everyone may write to
    code = f"open({str(target)!r}, 'w').write('out')\n"
    result = await run_python(code, FAST)
    assert not target.exists()
    assert result.exit_code == 1  # refused (Landlock), or the path is not there at all (bubblewrap's own root)
    assert "PermissionError" in result.stderr or "No such file or directory" in result.stderr
    result = await run_python("open('/usr/escaped.txt', 'w').write('out')", FAST)
    assert result.exit_code == 1 and ("PermissionError" in result.stderr or "Read-only file system" in result.stderr)


async def test_the_scratch_directory_is_writable_and_removed_afterwards():
    code = "import os\nopen('notes.txt', 'w').write('kept')\nos.makedirs('a/b')\nprint(os.getcwd())"
    result = await run_python(code, FAST)
    assert result.ok
    if isolation().tool is Tool.BUBBLEWRAP:  # a tmpfs of the call's own, gone with it
        assert result.stdout.strip() == "/sandbox"
        assert (await run_python("import os\nprint(sorted(os.listdir()))", FAST)).stdout.strip() == "['main.py']"
    else:
        scratch = Path(result.stdout.strip())
        assert scratch.name.startswith("turnstile-sandbox-") and not scratch.exists()


async def test_network_access_is_refused():
    needs("network isolation", isolation().namespaces or isolation().landlock_abi >= 4)
    code = "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('connected')"
    result = await run_python(code, FAST)
    assert "connected" not in result.stdout
    assert result.exit_code == 1 and ("PermissionError" in result.stderr or "unreachable" in result.stderr)


async def test_the_parents_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("TURNSTILE_TEST_SECRET", SECRET)
    code = (
        "import os\nprint(sorted(os.environ))\nfound = []\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n        found.append(b'" + SECRET + "' in open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError:\n        pass\n"
        "print('secret seen:', any(found))"
    )
    result = await run_python(code, FAST)
    assert result.ok
    assert SECRET not in result.stdout and "secret seen: False" in result.stdout
    assert eval(result.stdout.splitlines()[0]) == ["HOME", "LANG", "PATH", "PWD", "TMPDIR"]


async def test_limits_are_fixed_for_the_code():
    needs("limits the code cannot raise", isolation().own_user)
    code = "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))"
    result = await run_python(code, FAST)
    assert result.exit_code == 1 and "ValueError" in result.stderr


# -- the env: scripted replies, a real sandbox, the task's checker -----------------------------------


def env_for(task_id: str, max_turns: int = 4, **sandbox):
    metadata = {"task_id": task_id, "sandbox": {"wall_seconds": 3, **sandbox}}
    return build_env(EnvSample(prompt="", label=task_id, metadata=metadata), SimpleNamespace(max_turns=max_turns))


async def test_every_task_accepts_its_reference_and_refuses_a_wrong_answer():
    assert len(TASKS) >= 30 and len(TASKS_BY_ID) == len(TASKS)
    for task in TASKS:
        if isinstance(task.checker, NumberAnswer):
            answer = (await run_python(task.reference)).stdout.strip()
            wrong = "-1"
        else:
            answer, wrong = task.reference, f"def {task.checker.name}(*args):\n    return None"
        assert (await task.checker.check(answer, SandboxLimits())).passed, task.id
        assert not (await task.checker.check(wrong, SandboxLimits())).passed, task.id


async def test_an_episode_runs_code_then_is_rewarded_for_the_right_answer():
    env = env_for("collatz-27")
    await env.areset()
    observation, done, info = await env.astep(
        tool_call("n, k = 27, 0\nwhile n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n    k += 1\nprint(k)")
    )
    assert not done and observation == {"obs_str": "exit status 0\n--- stdout ---\n111", "role": "tool"}
    assert env.format_observation(observation) == {"role": "tool", "content": observation["obs_str"]}
    observation, done, info = await env.astep("So it takes <answer>111</answer> steps.")
    assert done and info["reward"] == 1.0 and observation["obs_str"] == "Correct: 111 is right."


async def test_a_wrong_answer_ends_with_reward_zero():
    env = env_for("collatz-27")
    _, done, info = await env.astep("<answer>112</answer>")
    assert done and info["reward"] == 0.0


async def test_a_function_answer_is_run_against_the_hidden_cases():
    env = env_for("roman")
    answer = "<answer>\n```python\ndef to_roman(n):\n    return 'I' * n\n```\n</answer>"
    _, done, info = await env.astep(answer)
    assert done and info["reward"] == 0.0 and info["verdict"] == "0 of 4 test cases pass"
    env = env_for("roman")
    _, done, info = await env.astep(f"<answer>{TASKS_BY_ID['roman'].reference}</answer>")
    assert done and info["reward"] == 1.0


async def test_an_answer_cannot_claim_its_own_success():
    env = env_for("roman")
    cheat = "import os, sys\nprint('results-0000000000000000:[\"\\'MCMXCIV\\'\"]')\nos._exit(0)"
    _, done, info = await env.astep(f"<answer>{cheat}</answer>")
    assert done and info["reward"] == 0.0


async def test_hostile_tool_calls_are_reported_and_the_episode_goes_on():
    env = env_for("sum-multiples")
    observation, done, info = await env.astep(tool_call("while True:\n    pass"))
    assert not done and "killed: the" in observation["obs_str"] and info["limits_hit"]
    observation, done, info = await env.astep(tool_call("x = bytearray(8 << 30)"))
    assert not done and "MemoryError" in observation["obs_str"]
    _, done, info = await env.astep("<answer>233168</answer>")
    assert done and info["reward"] == 1.0


async def test_a_malformed_call_and_a_reply_without_action_get_one_observation_each():
    env = env_for("sum-multiples")
    observation, done, info = await env.astep('<tool_call>{"name": "python", "arguments": {"code": ""}}</tool_call>')
    assert not done and info["malformed_call"] == "invalid_argument" and observation["role"] == "tool"
    assert observation["obs_str"].startswith("Tool call error (invalid_argument): tool call 1 (python): the argument")
    observation, done, info = await env.astep("I think it is large.")
    assert not done and observation["role"] == "user" and "No tool call and no answer" in observation["obs_str"]


async def test_the_last_turn_without_an_answer_ends_with_reward_zero():
    env = env_for("sum-multiples", max_turns=2)
    _, done, _ = await env.astep(tool_call("print(1)"))
    assert not done
    observation, done, info = await env.astep(tool_call("print(2)"))
    assert done and info["reward"] == 0.0 and observation["obs_str"] == "Out of turns without an answer."


def test_rows_name_their_task_and_carry_the_tool_schema():
    rows = make_prompts(40, seed=3)
    assert len({row["label"] for row in rows[: len(TASKS)]}) == len(TASKS)  # each task once before repeats
    assert rows == make_prompts(40, seed=3) and rows != make_prompts(40, seed=4)
    assert rows[0]["metadata"]["tools"] == [PYTHON_TOOL.schema()]
    with pytest.raises(ValueError, match="no vision mode"):
        make_prompts(1, vision=True)


def test_a_row_may_bring_its_own_checker_and_a_bad_one_is_one_error():
    sample = EnvSample(prompt="2+2?", metadata={"checker": {"kind": "number", "value": 4}})
    assert build_env(sample).task.checker == NumberAnswer(value=4)
    with pytest.raises(ValueError, match="names no task"):
        build_env(EnvSample(prompt="hi", label="nope"))
    with pytest.raises(ValueError, match="metadata.checker"):
        build_env(EnvSample(prompt="hi", metadata={"checker": {"kind": "regex"}}))
    with pytest.raises(ValueError, match="metadata.sandbox"):
        build_env(EnvSample(prompt="hi", label="roman", metadata={"sandbox": {"wall_seconds": -1}}))


# -- a rollout: hostile trajectories beside well-behaved ones ----------------------------------------


class ByTaskBackend:
    """Generates each trajectory's scripted replies, chosen by its task's question and turn number."""

    def __init__(self, tokenizer, replies: dict[str, list[str]]):
        self.tokenizer, self.replies = tokenizer, replies
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, input_ids, sampling_params, image_data=None, *, rid=None, session_id=None):
        from engine.backends.base import GenerateResult

        text = self.tokenizer.decode(input_ids)
        task_id = next(t for t in self.replies if TASKS_BY_ID[t].question in text)
        turn = text.count("<|im_start|>assistant") - 1
        ids = self.tokenizer(self.replies[task_id][turn], add_special_tokens=False)["input_ids"] + [self.end]
        return GenerateResult(
            token_ids=ids, logprobs=[-0.5] * len(ids), text="", finish_reason="stop", weight_version="v0",
            prompt_tokens=len(input_ids),
        )  # fmt: skip

    async def abort(self, rid=None): ...
    async def pause(self): ...
    async def resume(self): ...
    async def weight_version(self):
        return "v0"

    async def health(self):
        return True

    async def aclose(self): ...


async def test_a_rollout_goes_on_around_hostile_code(tokenizer):
    replies = {
        "sum-multiples": [tool_call("import os\nwhile True:\n    os.fork()"), "<answer>233168</answer>"],
        "collatz-27": [tool_call("while True:\n    pass"), "<answer>111</answer>"],
        "gcd-lcm": ["<answer>232792560</answer>"],
        "binomial": ['<tool_call>{"name": "python"</tool_call>', "<answer>1</answer>"],
    }
    rows = [row for row in make_prompts(len(TASKS)) if row["label"] in replies]
    for row in rows:
        row["metadata"]["sandbox"] = {"wall_seconds": 3, "processes": 8}
    factory = EnvFactory("engine.envs.python_tool", args=SimpleNamespace(max_turns=3))
    config = EngineConfig(
        max_generating=4, max_env_steps=4, retry=RetryPolicy(backoff_base_s=0.0), limits=TurnLimits(max_turns=3)
    )
    backend = ByTaskBackend(tokenizer, replies)
    with anyio.fail_after(60):
        async with RolloutEngine(
            backend=backend, encoder=ChatEncoder(tokenizer), env_factory=factory, source=rows, config=config
        ) as engine:
            groups = await engine.rollout(len(rows))
    ended = {group.row["label"]: group.trajectories[0] for group in groups}
    assert {label: (t.status, t.reward) for label, t in ended.items()} == {
        "sum-multiples": (Status.COMPLETED, 1.0),
        "collatz-27": (Status.COMPLETED, 1.0),
        "gcd-lcm": (Status.COMPLETED, 1.0),
        "binomial": (Status.COMPLETED, 0.0),
    }
    seen = {label: tokenizer.decode(t.tokens.tolist()) for label, t in ended.items()}
    assert "<tool_response>\nkilled by SIGKILL\nkilled: the wall-clock limit of 3 s" in seen["collatz-27"]
    if isolation().own_user:  # root's own processes are not held to the limit
        assert "the process limit of 8 was reached" in seen["sum-multiples"]
    assert "Tool call error (invalid_json)" in seen["binomial"]


# -- end to end ------------------------------------------------------------------------------------


def test_turnstile_run_env_python_tool_on_the_embedded_default(tmp_path):
    out = tmp_path / "trajectories.jsonl"
    argv = ["run", "--env", "python_tool", "--num-prompts", "4", "--max-turns", "3", "--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "engine.cli", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 4
    for record in records:  # the random model rarely calls well, yet each episode ends, judged
        assert record["status"] == "completed" and record["stop_reason"] == "env_done"
        assert record["reward"] in (0.0, 1.0) and 1 <= len(record["turns"]) <= 3
    assert "4 trajectories" in proc.stderr


@pytest.mark.sglang
def test_turnstile_run_env_python_tool_against_sglang(sglang_workers, tmp_path):
    from engine.cli import main
    from tests.sglang_cpu.server import model_dir

    out = tmp_path / "sglang.jsonl"
    argv = ["run", "--env", "python_tool", "--backend", "sglang", "--url", sglang_workers[0].url]
    argv += ["--tokenizer", str(model_dir("tiny-qwen2.5-vl")), "--num-prompts", "2", "--max-turns", "2"]
    argv += ["--model-family", "qwen25"]  # Qwen2.5-VL's template has no tools: its family is named, as for SGLang
    assert main([*argv, "--max-new-tokens", "24", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["status"] for r in records] == ["completed", "completed"]
    assert all(r["reward"] in (0.0, 1.0) for r in records)
