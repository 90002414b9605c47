"""Turnstile installed into slime's image, as a user installs it there: a plain `pip install <checkout>` into a
copy of the venv that holds slime's image's pins (tests/slime_image.py). pip must change none of what was
there, and the installed package must run: the bridge imports without importing torch, the embedded default
`generate_rollout` through slime's signature returns whole groups, and `turnstile run --vision` runs the tiny
VL model on the pinned torch, torchvision and transformers.

Skips without the pinned venv (`python -m tests.slime_image install`); fails instead under
TURNSTILE_REQUIRE_SLIME_IMAGE=1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import slime_image

pytestmark = [pytest.mark.slime_image, pytest.mark.slow]

GROUPS_OF = 2
# slime's side of one rollout step: a data source handing out groups of GROUPS_OF copies of one prompt (as
# slime's RolloutDataSource does), and generate_rollout called as slime calls it, with the embedded default.
ROLLOUT = f"""
import json
from bridge.convert import sample_class
from bridge.slime import generate_rollout

class DataSource:
    def __init__(self):
        self.next = 0

    def get_samples(self, num):
        Sample, groups = sample_class(), []
        for _ in range(num):
            g, size = self.next, {GROUPS_OF}
            groups.append([Sample(group_index=g, index=g * size + i, prompt=f"prompt-{{g}}") for i in range(size)])
            self.next += 1
        return groups

out = generate_rollout(None, 0, DataSource())
print(json.dumps([[dict(index=s.index, group_index=s.group_index, status=s.status.value, tokens=len(s.tokens),
                        response_length=s.response_length, loss_mask=len(s.loss_mask or []),
                        errors=s.metadata.get("errors"))
                   for s in group] for group in out.samples]))
"""
IMPORTS = """
import json, sys
import bridge.slime, engine.engine, engine.backends.sglang, engine.cli
print(json.dumps({"file": bridge.__file__, "torch": [m for m in ("torch", "torchvision") if m in sys.modules]}))
"""


@pytest.fixture(scope="module")
def installed():
    """A copy of the pinned venv with Turnstile pip-installed into it; the versions before and after."""
    if not slime_image.is_installed():
        reason = f"no slime-image venv at {slime_image.venv_dir()}: run `python -m tests.slime_image install`"
        if os.environ.get("TURNSTILE_REQUIRE_SLIME_IMAGE") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    work = Path(tempfile.mkdtemp(prefix="slime-image-test-", dir=slime_image.venv_dir().parent))  # hard links
    try:
        venv = slime_image.copy_venv(work / "venv")
        before, unmet_before = slime_image.versions(venv), slime_image.pip_check(venv)
        source = slime_image.checkout_copy(work / "turnstile")
        output = slime_image.pip_install(venv, str(source))
        yield SimpleNamespace(
            venv=venv, work=work, source=source, before=before, after=slime_image.versions(venv), pip_output=output,
            unmet_before=unmet_before, unmet_after=slime_image.pip_check(venv),
        )  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_in(installed, *command: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`command` in the copy, outside the checkout (so the installed package is what imports), with a fresh
    Turnstile cache: the tokenizer and tiny models are built there by the pinned transformers."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["TURNSTILE_CACHE"] = str(installed.work / "cache")
    done = subprocess.run(command, cwd=installed.work, env=env, capture_output=True, text=True, timeout=timeout)
    shown = " ".join(command).splitlines()[0][:200]
    assert done.returncode == 0, f"`{shown} ...` failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_pip_install_changes_none_of_the_images_packages(installed):
    diff = slime_image.changes(installed.before, installed.after)
    changed = {name: v for name, v in diff.items() if v[0] is not None}
    added = sorted(f"{name} {v[1]}" for name, v in diff.items() if v[0] is None)
    print(f"pip added: {', '.join(added)}")
    assert {name: installed.after.get(name) for name in slime_image.PINS} == slime_image.PINS
    assert not changed, f"pip changed {changed} (added {added}):\n{installed.pip_output[-3000:]}"
    assert "turnstile" in installed.after
    assert installed.unmet_before == "" and installed.unmet_after == "", installed.unmet_after


def test_the_torch_extra_is_met_by_the_images_torch_and_torchvision(installed):
    would = slime_image.pip_would_install(installed.venv, f"{installed.source}[torch]")
    assert set(would) <= {"turnstile"}, would


def test_the_installed_bridge_imports_without_torch(installed):
    done = run_in(installed, str(slime_image.python_of(installed.venv)), "-c", IMPORTS)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(found["file"]).is_relative_to(installed.venv)  # the installed package, not the checkout
    assert found["torch"] == []


def test_the_embedded_default_rollout_returns_whole_groups_through_slimes_signature(installed):
    done = run_in(installed, str(slime_image.python_of(installed.venv)), "-c", ROLLOUT)
    groups = json.loads(done.stdout.strip().splitlines()[-1])
    assert groups and all(len(group) == GROUPS_OF for group in groups)
    for group in groups:
        assert len({s["group_index"] for s in group}) == 1
        for sample in group:
            assert sample["status"] == "completed", sample["errors"]
            assert sample["response_length"] == sample["loss_mask"] > 0, sample
            assert sample["tokens"] > sample["response_length"], sample  # the prompt comes first


def test_turnstile_run_vision_runs_on_the_pinned_torch_and_transformers(installed):
    out = installed.work / "vision.jsonl"
    turnstile = installed.venv / "bin" / "turnstile"
    run_in(installed, str(turnstile), "run", "--vision", "--num-prompts", "2", "--out", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(row["num_images"] > 0 for row in rows), rows
    assert all(row["status"] == "completed" for row in rows), [(row["status"], row["errors"]) for row in rows]
    assert all(row["response_length"] == len(row["loss_mask"]) for row in rows)


def test_the_readmes_smoke_test_runs_there_as_written(installed):
    from tests.test_readme import blocks

    [script] = [body for body in blocks("python") if body.startswith("from bridge.slime import generate_rollout")]
    done = run_in(installed, str(slime_image.python_of(installed.venv)), "-c", script)
    assert done.stdout.count("('completed', ") == 8, done.stdout  # 2 groups of 4
