"""`turnstile show FILE`: a run's trajectories as a person reads them, turn by turn, the model's text and the
environment's apart, with the stop reason, reward and errors (tracebacks included)."""

from __future__ import annotations

import json

import pytest

from engine.cli import main

BUGGY_ENV = """
from engine.envs.base import BaseInteractionEnv


class GuessEnv(BaseInteractionEnv):
    def reset(self):
        return {}, {}

    def step(self, response_text):
        if self.turn_index == 1:
            return self._check(response_text)
        self.turn_index += 1
        return {"obs_str": "Not quite: guess again."}, False, {}

    def _check(self, text):
        raise ValueError("my bug: " + str(len(text)))


def build_env(sample=None, args=None, **kw):
    env = GuessEnv()
    env.turn_index = 0
    return env
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two files of one run each: the arithmetic env, and an env that raises at its second step (no text)."""
    folder = tmp_path_factory.mktemp("show")
    (folder / "buggy_env.py").write_text(BUGGY_ENV)
    argv = ["run", "--num-prompts", "2", "--max-turns", "3", "--max-new-tokens", "5"]
    assert main([*argv, "--out", str(folder / "arith.jsonl")]) == 0
    buggy = ["--env", str(folder / "buggy_env.py"), "--prompts", str(folder / "rows.jsonl"), "--no-text"]
    (folder / "rows.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "guess"}]}) + "\n")
    assert main([*argv, *buggy, "--out", str(folder / "buggy.jsonl")]) == 1
    return folder


def show(capsys, *argv: str) -> tuple[int, str]:
    code = main(["show", *argv])
    return code, capsys.readouterr().out


def test_each_trajectory_shows_its_outcome_prompt_and_turns_with_model_and_env_text_apart(runs, capsys):
    code, out = show(capsys, str(runs / "arith.jsonl"))
    records = [json.loads(line) for line in (runs / "arith.jsonl").read_text().splitlines()]
    assert code == 0 and out.count("\ntrajectory ") + out.startswith("trajectory ") == len(records) == 2
    for record in records:
        header = f"trajectory {record['id']} · group {record['group_id']}, member {record['index']} · "
        assert header + f"{record['status']} ({record['stop_reason']}) · reward {record['reward']}" in out
        for turn in record["turns"]:
            assert f"turn {turn['index']} · model {turn['num_generated']} tokens" in out
        question = record["metadata"]["question"]
        assert f"What is {question}? Answer with a number." in out  # the prompt, and the env's answers
    assert out.count("  model ▸") == sum(len(r["turns"]) for r in records)
    assert out.count("  env ▸") == sum(1 for r in records for t in r["turns"] if t["num_observation"])


def test_id_and_status_pick_trajectories_and_say_when_none_matches(runs, capsys):
    [first, second] = [json.loads(line) for line in (runs / "arith.jsonl").read_text().splitlines()]
    code, out = show(capsys, str(runs / "arith.jsonl"), "--id", str(second["id"]))
    assert code == 0 and f"trajectory {second['id']} ·" in out and f"trajectory {first['id']} ·" not in out
    code, out = show(capsys, str(runs / "arith.jsonl"), "--status", "failed")
    assert code == 0 and out.strip() == f"{runs / 'arith.jsonl'}: no trajectory with status failed (of 2)"


def test_errors_show_the_envs_traceback_and_a_file_without_text_is_decoded_with_a_tokenizer(runs, capsys):
    [record] = [json.loads(line) for line in (runs / "buggy.jsonl").read_text().splitlines()]
    assert "prompt_text" not in record
    code, out = show(capsys, str(runs / "buggy.jsonl"))
    assert code == 0 and "(no text in this file, written with --no-text: give --tokenizer to decode its tokens)" in out
    assert "error env_exception (env, turn 1): env GuessEnv.step raised ValueError('my bug: " in out
    assert 'buggy_env.py", line 11, in step' in out and 'buggy_env.py", line 16, in _check' in out
    assert "engine/envs/base.py" not in out and "anyio" not in out  # the env's own frames only
    code, out = show(capsys, str(runs / "buggy.jsonl"), "--tokenizer", "qwen2.5")
    assert code == 0 and "guess" in out and "Not quite: guess again." in out and "  env ▸" in out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json\n", "bad.jsonl:1: not a JSON object"),
        ('{"prompt": []}\n', "bad.jsonl:1: not a trajectory (turnstile run writes one per line)"),
    ],
)
def test_a_file_that_is_not_trajectories_is_one_error(tmp_path, capsys, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    assert main(["show", str(tmp_path / "bad.jsonl")]) == 2
    assert f"turnstile: error: {tmp_path / message}" in capsys.readouterr().err
