"""What importing Turnstile costs: torch and torchvision belong to the `torch` extra (the local backend, the tiny
models, VLM processors' tensors), so the bridge, the engine, the SGLang backend and the CLI's parser import
neither, and the text path over SGLang (tokenizer, chat encoder) works where torch is not installed at all.
Each check runs in a fresh interpreter: this one has long since imported torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

IMPORTS = "import bridge.slime, engine.engine, engine.backends.sglang, engine.cli; engine.cli.build_parser()"
TORCH = ("torch", "torchvision")


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_the_bridge_engine_sglang_backend_and_cli_import_without_torch():
    found = run_python(f"import sys, json; {IMPORTS}; print(json.dumps([m for m in {TORCH!r} if m in sys.modules]))")
    assert json.loads(found) == []


def test_the_text_path_over_sglang_works_where_torch_is_not_installed():
    hidden = "import sys; sys.modules.update(dict.fromkeys(('torch', 'torchvision')))"  # None: import fails
    code = f"""{hidden}
import json
{IMPORTS}
from engine.encoding import ChatEncoder
from engine.models import load_tokenizer
encoder = ChatEncoder(load_tokenizer("qwen2.5"))
prompt = encoder.encode_prompt([{{"role": "user", "content": "What is 2 + 2?"}}])
observation = encoder.encode_observation({{"role": "user", "content": "4"}})
print(json.dumps([encoder.response_text(prompt.token_ids, skip_special_tokens=False), len(observation.token_ids)]))
"""
    text, observed = json.loads(run_python(code))
    assert "What is 2 + 2?" in text and text.endswith("<|im_start|>assistant\n")
    assert observed > 0


AGENTS_EXTRA = ("starlette", "uvicorn", "httptools", "openai", "anthropic", "psutil", "agents")


def test_without_the_agents_extra_the_cli_runs_and_its_agent_parts_name_the_extra(tmp_path):
    """A plain `pip install turnstile` (slime's image) has none of the agents extra: `turnstile run` imports, and
    `turnstile gateway` and the agent envs refuse at start with one error naming the extra."""
    hidden = f"import sys; sys.modules.update(dict.fromkeys({AGENTS_EXTRA!r}))"
    code = f"""{hidden}
import contextlib, io, json
{IMPORTS}
from engine.cli import main
errors = []
for argv in (["gateway"], ["run", "--agent-command", "true", "--out", {str(tmp_path / "out.jsonl")!r}]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        main(argv)
    errors.append(err.getvalue().strip().splitlines()[-1])
print(json.dumps(errors))
"""
    gateway, agent_command = json.loads(run_python(code))
    for error in (gateway, agent_command):
        assert error.startswith("turnstile: error:") and "pip install 'turnstile[agents]'" in error, error
    assert "`turnstile gateway`" in gateway and "agent_command" in agent_command


def test_the_repository_tracks_sources_only():
    """No virtual environment (a `.venv` link included), no wheel, no file over 1 MiB is in the tree a user clones."""
    done = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.skip(f"not a git checkout: {done.stderr.strip()}")
    tracked = [path for path in done.stdout.split("\0") if path]
    assert not [p for p in tracked if p.split("/")[0] in (".venv", "venv") or p.endswith((".whl", ".pyc"))]
    assert not [p for p in tracked if (REPO / p).is_file() and (REPO / p).stat().st_size > 1 << 20]
