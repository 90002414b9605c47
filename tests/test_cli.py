"""`turnstile run` end to end: the embedded default, the VLM mode, an SGLang server, and bad input."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest

from engine.cli import build_parser, main, settings_from_flags
from engine.config import Settings
from engine.envs.arith import make_prompts
from tests.sglang_double import Generate, SGLangDouble

REQUIRED = {"tokens", "prompt_length", "loss_mask", "logprobs", "status", "stop_reason", "turns", "reward"}


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_record(record: dict) -> None:
    assert record.keys() >= REQUIRED
    response = len(record["tokens"]) - record["prompt_length"]
    assert len(record["loss_mask"]) == len(record["logprobs"]) == response
    generated = sum(turn["num_generated"] for turn in record["turns"])
    assert sum(record["loss_mask"]) == generated
    for mask, logprob in zip(record["loss_mask"], record["logprobs"], strict=True):
        assert (logprob <= 0.0) if mask else (logprob == 0.0)


def test_console_script_runs_the_embedded_default(tmp_path):
    out = tmp_path / "trajectories.jsonl"
    argv = ["run", "--num-prompts", "3", "--max-new-tokens", "8", "--max-turns", "3", "--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "engine.cli", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = read_lines(out)
    assert len(records) == 3
    for record in records:
        check_record(record)
        assert record["status"] in {"completed", "truncated"}
    # a random model rarely answers right: the built-in env keeps it going for several turns
    assert max(len(r["turns"]) for r in records) == 3
    assert "3 trajectories" in proc.stderr


def test_vision_mode_puts_images_in_observations(tmp_path):
    out = tmp_path / "vlm.jsonl"
    assert (
        main(["run", "--vision", "--num-prompts", "2", "--max-new-tokens", "6", "--max-turns", "3", "--out", str(out)])
        == 0
    )
    records = read_lines(out)
    assert len(records) == 2
    for record in records:
        check_record(record)
        # the prompt's image and one per feedback observation reached the backend
        assert record["num_images"] == len([t for t in record["turns"] if t["num_observation"]]) + 1


def test_sglang_backend_flag_drives_a_server(tmp_path, tokenizer):
    row = make_prompts(1)[0]
    answer = tokenizer(row["label"], add_special_tokens=False)["input_ids"] + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]
    with SGLangDouble(weight_version="step-7") as server:
        server.script(Generate(token_ids=[15, 16]), Generate(token_ids=answer))
        out = tmp_path / "sglang.jsonl"
        argv = ["run", "--backend", "sglang", "--url", server.url, "--tokenizer", "qwen2.5", "--num-prompts", "1"]
        assert main([*argv, "--out", str(out)]) == 0
        sent = server.requests_to("/generate")
    [record] = read_lines(out)
    check_record(record)
    assert (record["status"], record["stop_reason"], record["reward"]) == ("completed", "env_done", 1.0)
    assert record["weight_versions"] == ["step-7", "step-7"]
    assert sent[1].body["input_ids"] == record["tokens"][: len(sent[1].body["input_ids"])]
    assert sent[0].body["return_logprob"] is True


def test_a_server_that_is_down_is_one_clear_error(tmp_path, capsys):
    assert (
        main(
            [
                "run",
                "--backend",
                "sglang",
                "--url",
                "http://127.0.0.1:9",
                "--tokenizer",
                "qwen2.5",
                "--num-prompts",
                "1",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    assert "http://127.0.0.1:9 is not healthy" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--env-path", "no_such_pkg.env"], "env module 'no_such_pkg.env' does not import"),
        (["--backend", "sglang"], "backend kind 'sglang' needs a url"),
        (["--max-turns", "0"], "max_turns"),
        (["--prompts", "PROMPTS"], "rows.jsonl:2: not a JSON object"),
    ],
)
def test_bad_input_is_one_error_naming_it(tmp_path, capsys, argv, message):
    prompts = tmp_path / "rows.jsonl"
    prompts.write_text('{"prompt": [{"role": "user", "content": "hi"}]}\n{"prompt": [\n')
    argv = [str(prompts) if a == "PROMPTS" else a for a in argv]
    with pytest.raises(SystemExit) as exited:
        main(["run", "--num-prompts", "1", "--out", str(tmp_path / "x"), *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_build_env_failing_for_one_prompt_fails_that_trajectory_only(tmp_path):
    env_file = tmp_path / "picky_env.py"
    env_file.write_text(
        "from engine.envs.base import BaseInteractionEnv\n"
        "class Env(BaseInteractionEnv):\n"
        "    def reset(self): return {}, {}\n"
        "    def step(self, text): return {}, True, {'reward': 0.5}\n"
        "def build_env(sample=None, args=None, **kw):\n"
        "    if sample.label == 'bad': raise KeyError('no sandbox image for this task')\n"
        "    return Env()\n"
    )
    prompts = tmp_path / "rows.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"task {label}"}], "label": label} for label in ("good", "bad")]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out.jsonl"
    assert (
        main(
            ["run", "--env-path", str(env_file), "--prompts", str(prompts), "--max-new-tokens", "4", "--out", str(out)]
        )
        == 0
    )
    by_status = {record["status"]: record for record in read_lines(out)}
    assert by_status.keys() == {"completed", "failed"}
    failed = by_status["failed"]
    assert failed["stop_reason"] == "env_error" and failed["turns"] == []
    assert "build_env raised KeyError('no sandbox image for this task')" in failed["errors"][0]["message"]
    assert by_status["completed"]["reward"] == 0.5


def test_run_serves_metrics_logs_turns_and_reports_progress(tmp_path, capsys):
    out = tmp_path / "run.jsonl"
    argv = ["run", "--num-prompts", "2", "--max-turns", "2", "--max-new-tokens", "4", "--metrics-port", "0"]
    assert main([*argv, "--log-level", "info", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    turns = [e for e in events if e["event"] == "turn"]
    assert len(turns) == sum(len(r["turns"]) for r in read_lines(out))
    assert "turnstile: metrics at http://127.0.0.1:" in err
    assert "groups 2/2 · in flight" in err  # the live view's last line, plain when not on a terminal


def test_env_takes_a_short_name_and_rows_come_from_the_env_modules_make_prompts(tmp_path, capsys):
    args = build_parser().parse_args(["run", "--env", "python_tool"])
    assert settings_from_flags(args).env_path == "engine.envs.python_tool"
    assert Settings(rollout_interaction_env_path="arith").env_path == "engine.envs.arith"  # slime's YAML key too
    env_file = tmp_path / "own_rows_env.py"
    env_file.write_text(
        "from engine.envs.base import BaseInteractionEnv\n"
        "class Env(BaseInteractionEnv):\n"
        "    def __init__(self, reward): self.reward = reward\n"
        "    def reset(self): return {}, {}\n"
        "    def step(self, text): return {}, True, {'reward': self.reward}\n"
        "def make_prompts(n, *, seed=0, vision=False):\n"
        "    rows = [{'prompt': [{'role': 'user', 'content': 't'}], 'label': str(seed + i)} for i in range(n)]\n"
        "    return rows\n"
        "def build_env(sample=None, args=None, **kw): return Env(float(sample.label))\n"
    )
    out = tmp_path / "out.jsonl"
    argv = ["run", "--env", str(env_file), "--num-prompts", "3", "--seed", "10", "--max-new-tokens", "4"]
    assert main([*argv, "--out", str(out)]) == 0
    assert sorted(record["reward"] for record in read_lines(out)) == [10.0, 11.0, 12.0]

    bare = tmp_path / "bare_env.py"
    bare.write_text(env_file.read_text().replace("def make_prompts", "def other_rows"))
    with pytest.raises(SystemExit) as exited:
        main(["run", "--env", str(bare), "--out", str(tmp_path / "x.jsonl")])
    assert exited.value.code == 2
    message = f"env module {str(bare)!r} has no make_prompts(n, seed=, vision=): give prompt rows with --prompts"
    assert message in capsys.readouterr().err


def test_each_turn_carries_its_decoded_text_and_no_text_leaves_it_out(tmp_path, capsys, tokenizer):
    out = tmp_path / "run.jsonl"
    argv = ["run", "--num-prompts", "2", "--max-turns", "3", "--max-new-tokens", "6"]
    assert main([*argv, "--out", str(out)]) == 0
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    for record in read_lines(out):
        tokens, start = record["tokens"], record["prompt_length"]
        assert record["prompt_text"] == decode(tokens[:start]) and record["prompt_text"].endswith("assistant\n")
        for turn in record["turns"]:
            begin = start + turn["start"]
            middle = begin + turn["num_generated"]
            assert turn["response_text"] == decode(tokens[begin:middle])
            assert turn["observation_text"] == decode(tokens[middle : middle + turn["num_observation"]])
        observed = [turn["observation_text"] for turn in record["turns"] if turn["num_observation"]]
        assert observed and all(f"What is {record['metadata']['question']}?" in text for text in observed)

    bare = tmp_path / "bare.jsonl"
    assert main([*argv, "--no-text", "--log-level", "debug", "--out", str(bare)]) == 0
    for record in read_lines(bare):
        assert "prompt_text" not in record and all("response_text" not in turn for turn in record["turns"])
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith('{"trajectory"')]
    turns = {(e["trajectory"], e["turn"]): e for e in events if e["event"] == "turn"}
    for record in read_lines(bare):  # at debug level, the turn log has the text
        for turn in record["turns"]:
            begin = record["prompt_length"] + turn["start"]
            generated = record["tokens"][begin : begin + turn["num_generated"]]
            assert turns[(record["id"], turn["index"])]["response_text"] == decode(generated)


HUNG_ENV = """
import threading
from engine.envs.base import BaseInteractionEnv

NEVER = threading.Event()


class HungEnv(BaseInteractionEnv):
    replay_safe = True

    def reset(self):
        return {}, {}

    def step(self, response_text):
        NEVER.wait()  # hangs for good
        return {"obs_str": "never"}, True, {}


def build_env(sample=None, args=None, **kw):
    return HungEnv()


def make_prompts(n, seed=0, vision=False):
    return [{"prompt": [{"role": "user", "content": "wait"}]} for _ in range(n)]
"""


def turnstile(*argv: str, **kw) -> subprocess.Popen:
    """`turnstile` as a terminal starts it: Ctrl-C (SIGINT) at its default, even where the tests' own process was
    started with SIGINT ignored (a background job of a non-interactive shell is), which a child would inherit."""
    return subprocess.Popen(
        [sys.executable, "-m", "engine.cli", *argv], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kw,
    )  # fmt: skip


def test_a_hung_env_fails_its_trajectory_on_its_budget_and_the_process_exits_naming_the_calls_left(tmp_path):
    """Every step hangs for good: each try times out, and its retry does not wait for it; the trajectory fails on
    its spent budget, and the process says what it leaves running and exits anyway (its threads hang on)."""
    (tmp_path / "hung_env.py").write_text(HUNG_ENV)
    out = tmp_path / "out.jsonl"
    argv = ["run", "--env", str(tmp_path / "hung_env.py"), "--num-prompts", "1", "--max-new-tokens", "4"]
    proc = turnstile(*argv, "--env-step-timeout", "0.3", "--out", str(out))
    _, err = proc.communicate(timeout=300)  # a bound for a broken exit, not a measure (benchmarks.faults.hung_env)
    assert proc.returncode == 1, err  # every trajectory failed
    [record] = read_lines(out)
    assert (record["status"], record["stop_reason"]) == ("failed", "env_error")
    [error] = record["errors"]
    assert error["class"] == "env_timeout" and error["turn"] == 0
    assert "retry budget spent after 2 retries" in error["message"]
    assert record["turns"][0]["retries"] == 2 and record["metadata"]["retries"] == {"env_timeout": 2}
    lines = err.splitlines()
    summary = next(i for i, line in enumerate(lines) if line.startswith("1 trajectories in"))
    waiting, exiting = lines[summary + 1 :]
    assert waiting.startswith("turnstile: waiting at most 3s for 3 env call(s) left running in their threads")
    assert waiting.count("HungEnv.step (running ") == 3
    assert exiting == "turnstile: exiting; 3 still running, their envs not closed"


HALF_HUNG_ENV = """
import threading
from engine.envs.base import BaseInteractionEnv

NEVER = threading.Event()


class HalfEnv(BaseInteractionEnv):
    def __init__(self, hangs):
        self.hangs = hangs

    def reset(self):
        return {}, {}

    def step(self, response_text):
        if self.hangs:
            NEVER.wait()
        return {"obs_str": "done"}, True, {}


def build_env(sample=None, args=None, **kw):
    return HalfEnv(hangs=sample.metadata["i"] == 1)


def make_prompts(n, seed=0, vision=False):
    return [{"prompt": [{"role": "user", "content": "wait"}], "metadata": {"i": i}} for i in range(n)]
"""


def test_ctrl_c_ends_a_run_in_one_line_keeping_what_ended(tmp_path):
    """SIGINT while one trajectory hangs in its env and the other has been written: exit status 130, no
    traceback, the ended trajectory kept, and stderr's last line counting the lines written and naming where."""
    (tmp_path / "half_env.py").write_text(HALF_HUNG_ENV)
    out = tmp_path / "out.jsonl"
    argv = ["run", "--env", str(tmp_path / "half_env.py"), "--num-prompts", "2", "--max-new-tokens", "4"]
    proc = turnstile(*argv, "--out", str(out))
    try:
        for line in proc.stderr:  # the live view's line once the first group is written
            if line.startswith("groups 1/2"):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:  # a run that ignored the signal is not left behind
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]  # after what the run leaves running (the hung env's call) is said
    said = re.fullmatch(rf"turnstile: interrupted; (\d+) trajector(?:y|ies) written to {re.escape(str(out))}", last)
    assert said is not None, err
    records = read_lines(out)
    assert int(said[1]) == len(records) == 1
    assert records[0]["status"] == "completed" and records[0]["metadata"]["i"] == 0


FAILS_ONCE_ENV = """
from engine.envs.base import BaseInteractionEnv

FAILED = []


class OnceEnv(BaseInteractionEnv):
    replay_safe = True

    def reset(self):
        return {}, {}

    def step(self, response_text):
        if not FAILED:
            FAILED.append(1)
            raise ValueError("flaky")
        return {"obs_str": "done"}, True, {"reward": 1.0}


def build_env(sample=None, args=None, **kw):
    return OnceEnv()


def make_prompts(n, seed=0, vision=False):
    return [{"prompt": [{"role": "user", "content": "go"}]} for _ in range(n)]
"""


def test_one_retried_step_is_one_retry_in_the_turn_event_the_trajectory_the_metadata_and_live_line(tmp_path, capsys):
    (tmp_path / "once_env.py").write_text(FAILS_ONCE_ENV)
    out = tmp_path / "out.jsonl"
    argv = ["run", "--env", str(tmp_path / "once_env.py"), "--num-prompts", "1", "--max-new-tokens", "4"]
    assert main([*argv, "--log-level", "info", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    [turn] = [e for e in events if e["event"] == "turn"]
    [ended] = [e for e in events if e["event"] == "trajectory"]
    [record] = read_lines(out)
    assert turn["turn"] == record["turns"][0]["index"] == 0
    assert turn["retries"] == ended["retries"] == record["turns"][0]["retries"] == 1
    assert record["metadata"]["retries"] == {"env_exception": 1}
    assert [line for line in err.splitlines() if line.startswith("groups ")][-1].endswith("· retries 1")


def test_the_run_yaml_takes_the_runs_own_options_and_flags_override_them(tmp_path, capsys):
    out = tmp_path / "from-yaml.jsonl"
    config = tmp_path / "run.yaml"
    config.write_text(f"num_prompts: 3\nout: {out}\ntext: false\nmax_turns: 1\nmax_new_tokens: 4\n")
    assert main(["run", "--config", str(config)]) == 0
    records = read_lines(out)
    assert len(records) == 3 and all("prompt_text" not in r for r in records)
    assert main(["run", "--config", str(config), "--num-prompts", "2"]) == 0
    assert len(read_lines(out)) == 2


def test_the_built_in_agent_env_runs_from_the_command_line(tmp_path):
    """`--env python_agent`: each sample an OpenAI Agents SDK program against its session, on the embedded model."""
    pytest.importorskip("agents", reason="the python_agent env needs openai-agents (turnstile[agents])")
    out = tmp_path / "out.jsonl"
    assert main(["run", "--env", "python_agent", "--num-prompts", "2", "--max-turns", "2", "--out", str(out)]) == 0
    records = read_lines(out)
    assert [r["status"] for r in records] == ["completed", "completed"]  # the agent's exit ended each, env done
    assert all(r["reward"] in (0.0, 1.0) and r["metadata"]["agent"] == "PythonAgentEnv" for r in records)
