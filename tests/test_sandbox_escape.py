"""Every attack of tests/sandbox_attacks.py is stopped by the python tool's sandbox, run as root and as an
ordinary user; and the reward hack that gets through the hand-built fallback fails under bubblewrap."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.envs.python_tool import checkers, tasks
from engine.envs.python_tool.cgroups import cgroup_parent
from engine.envs.python_tool.sandbox import Tool, isolation, probe, run_python
from tests.sandbox_attacks import ATTACKS, FAST, Host, reward_hack_answer

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[1]
USER = 47011  # an ordinary user: no name, no home, no group but its own


def bubblewrap_or_fail() -> None:
    """The suite is about bubblewrap: without it the test fails, naming what is missing (CI installs it)."""
    found = isolation()
    assert found.tool is Tool.BUBBLEWRAP, f"no bubblewrap here (`apt-get install bubblewrap`): {found.not_enforced()}"
    assert found.cgroup is not None and found.seccomp is not None, found.not_enforced()


@pytest.mark.parametrize("name", list(ATTACKS))
async def test_stopped_as_root(name):
    if os.geteuid() != 0:
        pytest.skip("this test process is not root; the ordinary-user tier runs the attacks as this user")
    bubblewrap_or_fail()
    async with Host.open() as host:
        await ATTACKS[name](host)


def system_python() -> str:
    """The system's python3, which an ordinary user can run (this process's may sit under a home only its owner
    enters, as pyenv's does), of this one's version, so this venv's compiled packages import on it."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    assert python is not None, "no /usr/bin/python3 for the ordinary user to run the attacks on"
    asked = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True, text=True)
    version = tuple(map(int, asked.stdout.split()))
    assert version == sys.version_info[:2], f"{python} is Python {version}, this venv's packages are for {sys.version}"
    return python


@contextlib.contextmanager
def handed(*paths: str) -> Iterator[tuple[list[str], tuple[int, ...]]]:
    """`paths` as descriptors opened here, and their `/proc/self/fd/N` names in a child given them: the child reads
    below each path without the search permission its parents would ask (the clone, or its venv, may lie under
    a home only its owner enters)."""
    fds = tuple(os.open(path, os.O_RDONLY | os.O_DIRECTORY) for path in dict.fromkeys(paths))
    try:
        yield [f"/proc/self/fd/{fd}" for fd in fds], fds
    finally:
        for fd in fds:
            os.close(fd)


@pytest.fixture(scope="module")
def as_ordinary_user(tmp_path_factory):
    """Every attack, run once by `python -m tests.sandbox_attacks` as an ordinary user in control groups
    delegated to it; the outcomes by attack. Where this process is not root, it is that user. The user is
    handed the clone and this venv's packages as open descriptors, and runs the system's python3, so that
    wherever the clone lives it needs no path of it."""
    if os.geteuid() != 0:
        return {"uid": os.getuid(), "outcomes": None}
    bubblewrap_or_fail()
    python = system_python()
    parent = cgroup_parent()
    delegated = []
    for directory in parent.directories:
        group = directory / f"turnstile-attack-user-{secrets.token_hex(3)}"
        group.mkdir()
        delegated.append(group)
        for path in [group, *group.iterdir()]:
            os.chown(path, USER, USER)
    home = tmp_path_factory.mktemp("user")
    os.chown(home, USER, USER)
    packages = (sysconfig.get_path("purelib"), sysconfig.get_path("platlib"))
    try:
        with handed(str(REPO), *packages) as (paths, fds):
            env = {
                "PATH": "/usr/bin:/bin",
                "HOME": "/nonexistent",
                "TMPDIR": str(home),
                "PYTHONPATH": ":".join(paths),
                "TURNSTILE_ATTACK_CGROUPS": ":".join(map(str, delegated)),
            }
            done = subprocess.run(
                [python, "-m", "tests.sandbox_attacks"], cwd=home, env=env, user=USER, group=USER, extra_groups=[],
                pass_fds=fds, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout.splitlines()[-1])
    finally:
        for group in delegated:
            for child in group.iterdir():
                if child.is_dir():
                    child.rmdir()
            group.rmdir()


@pytest.mark.parametrize("name", list(ATTACKS))
async def test_stopped_as_an_ordinary_user(name, as_ordinary_user):
    if as_ordinary_user["outcomes"] is None:  # this process is the ordinary user
        bubblewrap_or_fail()
        async with Host.open() as host:
            await ATTACKS[name](host)
        return
    assert as_ordinary_user["uid"] == USER
    held = as_ordinary_user["isolation"]  # bubblewrap, in the delegated group, with the seccomp filter
    assert held.startswith("bubblewrap") and "no cgroup" not in held and "no seccomp" not in held, held
    assert as_ordinary_user["outcomes"][name] == "stopped", as_ordinary_user["isolation"]


@pytest.fixture
def readable_tasks():
    """tasks.py where any user may read it, as in a package installed under /usr (the clone may lie under a home
    only its owner enters, which would hide it from the sandbox's user whatever the sandbox)."""
    with tempfile.TemporaryDirectory(prefix="turnstile-installed-") as folder:
        os.chmod(folder, 0o755)
        table = Path(folder) / "tasks.py"
        shutil.copyfile(tasks.__file__, table)
        os.chmod(table, 0o644)
        yield str(table)


async def test_the_reward_hack_passes_the_hand_built_sandbox_and_fails_under_bubblewrap(monkeypatch, readable_tasks):
    """The attack is real: where the hand-built fallback runs the check, reading the task table passes."""
    bubblewrap_or_fail()
    checker = tasks.TASKS_BY_ID["reverse-words"].checker
    assert not (await checker.check(reward_hack_answer(readable_tasks), FAST)).passed
    monkeypatch.setattr(checkers, "run_python", functools.partial(run_python, found=probe(Tool.UNSHARE)))
    verdict = await checker.check(reward_hack_answer(readable_tasks), FAST)
    assert verdict.passed and verdict.detail == "3 of 3 test cases pass"


def test_the_sandbox_is_chosen_at_start_and_a_bad_choice_is_one_error(monkeypatch, caplog):
    monkeypatch.setenv("TURNSTILE_SANDBOX", "docker")
    with pytest.raises(ValueError, match="TURNSTILE_SANDBOX='docker': expected one of bubblewrap, unshare, none"):
        isolation.__wrapped__()
    monkeypatch.setenv("TURNSTILE_SANDBOX", "unshare")
    with caplog.at_level("WARNING", logger="engine.envs.python_tool.sandbox"):
        fallback = isolation.__wrapped__()
    assert fallback.tool is Tool.UNSHARE
    assert "python sandbox: no bubblewrap: the code reads every file its user may" in caplog.text  # said loudly


async def test_a_sandbox_that_fails_to_start_says_so_and_is_not_taken_for_a_kill():
    bubblewrap_or_fail()
    found = isolation()
    broken = dataclasses.replace(found, root=("--ro-bind", "/nonexistent-turnstile-path", "/x", *found.root))
    result = await run_python("print('never')", FAST, found=broken)
    assert result.exit_code == 1 and result.signal is None and result.limits_hit == ()
    assert "nonexistent-turnstile-path" in result.stderr and "never" not in result.stdout
