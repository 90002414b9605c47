"""The example's files say what the bridge reads: the YAML validates into Turnstile's settings, and the
launch script names functions that exist and parses as bash."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from bridge.settings import settings_from_args
from engine.envs.loader import load_env_module
from engine.errors import ErrorClass

EXAMPLE = Path(__file__).parents[1] / "examples" / "geo3k_vlm_multi_turn"


def test_the_example_config_is_what_the_bridge_reads():
    values = yaml.safe_load((EXAMPLE / "turnstile.yaml").read_text())
    args = SimpleNamespace(**values, rollout_batch_size=64, over_sampling_batch_size=96, partial_rollout=True)
    settings = settings_from_args(args)  # raises on any unknown or ill-typed key
    assert (settings.max_turns, settings.env_path) == (3, "examples.geo3k_vlm_multi_turn.env_geo3k")
    assert settings.over_sampling == 1.5  # the YAML's value wins over the flags' ratio
    assert set(settings.retry.per_turn) == set(ErrorClass)  # a class left out would get no retries at all
    config = settings.engine_config(stop_token_ids=(151645,))
    assert (config.max_generating, config.max_env_steps, config.metrics_port) == (512, 128, 9400)


def test_the_launch_script_names_real_functions_and_parses():
    script = (EXAMPLE / "run.sh").read_text()
    for path in re.findall(r"--(?:rollout|custom-generate|eval)-function-path (\S+)", script):
        module, _, name = path.rpartition(".")
        assert callable(getattr(load_env_module(module), name)), path
    assert "turnstile.yaml" in script and (EXAMPLE / "turnstile.yaml").exists()
    if shutil.which("bash") is None:
        pytest.skip("no bash to parse run.sh with")
    subprocess.run(["bash", "-n", str(EXAMPLE / "run.sh")], check=True)
