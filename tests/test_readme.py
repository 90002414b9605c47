"""The README runs as written: each fenced block is taken from it and run (bash lines as commands, python
blocks as scripts or, headed by a file name, as files the commands use), its slime flags and YAML read by
the bridge as slime would hand them over; a command that cannot run here is named below with the reason,
and a block that is neither run nor named fails the test. Each runs in a folder of its own that holds the
checkout's files by link, so what they write (out/) stays there."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from bridge.flags import FLAGS, Handling
from bridge.settings import settings_from_args
from tests.conftest import REPO

README = (REPO / "README.md").read_text()
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
NOT_RUN = {
    "make test": "the test suite itself, which this test is part of (CI's .ci/run runs it)",
    "pip install /path/to/turnstile": "an install into slime's image: tests/test_slime_image.py runs it with this "
    "checkout's path, into a venv holding slime's own pins of torch, torchvision, transformers and numpy",
}


def blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(README) if lang == language]


def commands() -> list[str]:
    """The README's bash commands, in order, comments dropped."""
    lines = [line.split(" # ", 1)[0].strip() for body in blocks("bash") for line in body.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_the_readme_is_short_and_every_block_is_a_kind_this_test_reads():
    assert len(README.splitlines()) <= 160
    assert {lang for lang, _ in BLOCK.findall(README)} <= {"", "bash", "python", "yaml", "text"}
    assert set(NOT_RUN) <= set(commands()), "NOT_RUN names a command the README no longer has"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A folder holding the checkout's top-level files by link, and the files the README's blocks name."""
    where = tmp_path_factory.mktemp("readme")
    for entry in REPO.iterdir():
        if entry.name not in ("out", ".git"):
            (where / entry.name).symlink_to(entry)
    for body in blocks("python"):
        first = body.splitlines()[0]
        if re.fullmatch(r"# [\w.]+\.py", first):
            (where / first[2:]).write_text(body)
    return where


@pytest.mark.slow
def test_every_bash_command_runs_as_written(folder):
    if not (REPO / ".venv" / "bin" / "turnstile").exists():
        pytest.fail("no .venv in the checkout: the README's commands run after `make` (`make test` creates it)")
    # as a user types them: not under the `make test ARGS=...` this suite may run in (make hands its command line's
    # variables down to every make below it)
    made = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ARGS")
    env = {name: value for name, value in os.environ.items() if name not in made}
    for command in commands():
        if command in NOT_RUN:
            print(f"not run here: {command!r}: {NOT_RUN[command]}")
            continue
        proc = subprocess.run(shlex.split(command), cwd=folder, capture_output=True, text=True, timeout=900, env=env)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        if command.startswith(".venv/bin/turnstile show") and "--status failed" not in command:
            assert "turn 0 · model" in proc.stdout and "  env ▸" in proc.stdout, proc.stdout
    written = [json.loads(line) for line in (folder / "out" / "guess.jsonl").read_text().splitlines()]
    assert len(written) == 4 and all(r["turns"] and r["turns"][0]["response_text"] for r in written)


@pytest.mark.slow
def test_every_python_script_runs_as_written(folder):
    scripts = [body for body in blocks("python") if not re.fullmatch(r"# [\w.]+\.py", body.splitlines()[0])]
    assert scripts
    for script in scripts:
        python = str(REPO / ".venv" / "bin" / "python")
        proc = subprocess.run([python, "-c", script], cwd=folder, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{script}\n{proc.stderr[-4000:]}"
        assert proc.stdout.count("('completed', ") + proc.stdout.count("('truncated', ") > 0, proc.stdout


def test_the_slime_flags_are_slimes_and_read_as_the_readme_says():
    [flags] = blocks("text")
    handling = {flag.option: flag.handling for flag in FLAGS}
    given = re.findall(r"(--[a-z-]+)(?: ([\w./]+))?", re.sub(r"#.*", "", flags))
    assert [option for option, _ in given] == ["--rollout-function-path", "--custom-config-path"]
    assert dict(given)["--rollout-function-path"] == "bridge.slime.generate_rollout"
    for option in re.findall(r"--[a-z-]+", flags):  # the optional ones in the comments too
        assert option in handling and handling[option] is not Handling.REFUSED, option


def test_the_yaml_is_a_custom_config_the_bridge_takes_as_written():
    [text] = blocks("yaml")
    values = yaml.safe_load(text)
    settings = settings_from_args(SimpleNamespace(**values))  # slime sets every top-level key on its args
    assert (settings.max_turns, settings.env_path) == (values["max_turns"], values["rollout_interaction_env_path"])
    for key, value in values["turnstile"].items():
        assert getattr(settings, key) == (settings.retry.model_copy(update=value) if key == "retry" else value), key


def test_the_readme_names_only_files_that_exist():
    for target in re.findall(r"\]\(((?!https?:)[^)#]+)\)", README):
        assert (REPO / target).exists(), target
    assert (REPO / "tests" / "test_slime_image.py").exists() and sys.version_info >= (3, 11)
