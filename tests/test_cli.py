"""`turnstile run` end to end: the embedded default, the VLM mode, an SGLang server, and bad input."""

from __future__ import annotations

import json
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
        assert main(["run", "--backend", "sglang", "--url", server.url, "--num-prompts", "1", "--out", str(out)]) == 0
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
