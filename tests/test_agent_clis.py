"""The agent CLIs people train, unmodified (Claude Code and Codex from npm, tests/agent_clis.py), through a session of
the gateway: a prompt, a real tool round trip (the policy calls the CLI's shell tool; the CLI runs it and sends its
output back), and the conversation continued by a second invocation (`--continue`, `exec resume --last`). Each
must exit 0 with no request refused, its session one linear chain (no fork) holding the sampled tokens with mask 1
exactly on them, and the tool's output in the chain's observation.

The policy is a scripted backend (tests/fakes.py: the sampled tokens are known, streamed one at a time) behind the
real Qwen2.5 tokenizer and template. Skips without the CLIs (`python -m tests.agent_clis install`); fails instead
under TURNSTILE_REQUIRE_AGENT_CLIS=1, as CI runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from engine.encoding import ChatEncoder
from engine.trajectory import Status
from engine.turn import TurnLimits
from tests import agent_clis
from tests.gateway_kit import assert_sampled_exactly, gateway_over, sampled

pytestmark = pytest.mark.slow
GREETING = "hello-from-turnstile"
CLI_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


def cli(name: str) -> Path:
    try:
        return agent_clis.binary(name)
    except agent_clis.AgentClisUnavailable as exc:
        if os.environ.get("TURNSTILE_REQUIRE_AGENT_CLIS") == "1":
            pytest.fail(str(exc))
        print(f"skipped: {exc}")
        pytest.skip(str(exc))


def call(encoder: ChatEncoder, name: str, arguments: dict) -> list[int]:
    return sampled(encoder, f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>")


async def run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """The CLI to its end, as a user runs it: no terminal, stdin closed, its own HOME."""
    with anyio.fail_after(CLI_TIMEOUT_S):
        done = await anyio.run_process(
            argv, env={"PATH": os.environ["PATH"], "LANG": "C.UTF-8", **env}, cwd=cwd, check=False,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    if done.returncode != 0:
        out, err = done.stdout.decode()[-3000:], done.stderr.decode()[-3000:]
        print(f"{argv[0]} exited {done.returncode}\nstdout: {out}\nstderr: {err}")
    return done


def check_session(gateway, session, turns: list[list[int]]) -> None:
    refused = {k: v for k, v in gateway.counts.items() if k.startswith(("bad_requests:", "internal_errors"))}
    assert refused == {}, refused
    assert session.forks == {} and len(session.chains) == 1, (
        session.forks,
        [c.trajectory.prompt[-1:] for c in session.chains],
    )
    (trajectory,) = [chain.trajectory for chain in session.chains]
    assert trajectory.status is Status.COMPLETED, trajectory.errors
    assert_sampled_exactly(trajectory, turns)
    observations = gateway.scheduler.encoder.tokenizer.decode(
        [t for i, t in enumerate(trajectory.response_ids) if not trajectory.loss_mask[i]]
    )
    assert GREETING in observations  # the tool ran, and its output came back to the model


@pytest.mark.anyio
async def test_claude_code_runs_a_tool_and_continues_through_a_session(encoder, tmp_path):
    claude = cli("claude")
    turns = [
        call(encoder, "Bash", {"command": f"echo {GREETING}", "description": "Print a greeting"}),
        sampled(encoder, f"The command printed {GREETING}."),
        sampled(encoder, "Nothing more to do."),
    ]
    gateway, _ = gateway_over(encoder, list(turns), limits=TurnLimits(max_turns=16, max_tokens=65536))
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    async with gateway.serving():
        session = gateway.open_session()
        env = {
            "HOME": str(home), "ANTHROPIC_BASE_URL": gateway.base_url(session, "anthropic"),
            "ANTHROPIC_API_KEY": session.key, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }  # fmt: skip
        first = await run(
            [str(claude), "-p", f"Run `echo {GREETING}`.", "--output-format", "json", "--allowedTools", "Bash"],
            env, work,
        )  # fmt: skip
        assert first.returncode == 0
        result = json.loads(first.stdout)
        assert result["is_error"] is False and result["result"] == f"The command printed {GREETING}."
        again = await run([str(claude), "-p", "Anything else?", "--continue", "--output-format", "json"], env, work)
        assert again.returncode == 0 and json.loads(again.stdout)["result"] == "Nothing more to do."
        await gateway.finish(session.id)
    check_session(gateway, session, turns)


CODEX_CONFIG = """model = "turnstile"
model_provider = "turnstile"

[model_providers.turnstile]
name = "Turnstile"
base_url = "{base_url}"
wire_api = "responses"
env_key = "TURNSTILE_API_KEY"
"""


@pytest.mark.anyio
async def test_codex_runs_a_tool_and_continues_through_a_session(encoder, tmp_path):
    codex = cli("codex")
    turns = [
        call(encoder, "exec_command", {"cmd": f"echo {GREETING}"}),
        sampled(encoder, f"The command printed {GREETING}."),
        sampled(encoder, "Nothing more to do."),
    ]
    gateway, _ = gateway_over(encoder, list(turns), limits=TurnLimits(max_turns=16, max_tokens=65536))
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True), work.mkdir()
    async with gateway.serving():
        session = gateway.open_session()
        (home / ".codex" / "config.toml").write_text(CODEX_CONFIG.format(base_url=gateway.base_url(session)))
        env = {"HOME": str(home), "TURNSTILE_API_KEY": session.key}
        flags = ["--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
        first = await run([str(codex), "exec", *flags, f"Run `echo {GREETING}`."], env, work)
        assert first.returncode == 0 and f"The command printed {GREETING}." in first.stdout.decode()
        again = await run([str(codex), "exec", "resume", "--last", *flags, "Anything else?"], env, work)
        assert again.returncode == 0 and "Nothing more to do." in again.stdout.decode()
        await gateway.finish(session.id)
    check_session(gateway, session, turns)


def test_claude_code_and_codex_through_turnstile_gateway_on_the_embedded_model(tmp_path):
    """The command a user starts (the embedded tiny model: its turns are noise, cut at the rollout's cap and
    reported to the CLI as ended), each CLI in a session of its own named in its URL: both exit 0, nothing
    refused, each session's chain written when Ctrl-C finishes it."""
    from tests.test_cli import read_lines
    from tests.test_gateway_command import gateway, interrupt, started

    claude, codex = cli("claude"), cli("codex")
    out, home, work = tmp_path / "sessions.jsonl", tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True), work.mkdir()
    with gateway("--port", "0", "--out", str(out), "--metrics-port", "0") as proc:
        served = started(proc)
        anthropic_url, openai_url = (served[api].replace("/demo", "/claude-1") for api in ("anthropic", "openai"))
        env = {
            "HOME": str(home), "ANTHROPIC_BASE_URL": anthropic_url, "ANTHROPIC_API_KEY": served["key"],
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "TURNSTILE_API_KEY": served["key"],
        }  # fmt: skip
        said = subprocess.run(
            [str(claude), "-p", "Say hello.", "--output-format", "json"], env={"PATH": os.environ["PATH"], **env},
            cwd=work, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert said.returncode == 0 and json.loads(said.stdout)["is_error"] is False, (said.stdout, said.stderr)
        config = CODEX_CONFIG.format(base_url=openai_url.replace("/claude-1/", "/codex-1/"))
        (home / ".codex" / "config.toml").write_text(config)
        done = subprocess.run(
            [str(codex), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "Say hello."],
            env={"PATH": os.environ["PATH"], **env}, cwd=work, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert done.returncode == 0, (done.stdout, done.stderr)
        err = interrupt(proc)
    assert proc.returncode == 0 and "Traceback" not in err, err
    records = read_lines(out)
    assert sorted(r["metadata"]["session_id"] for r in records) == ["claude-1", "codex-1"]
    assert all(r["status"] == "completed" and len(r["turns"]) >= 1 for r in records), records


def test_an_agent_cli_per_sample_through_turnstile_run(tmp_path):
    """`turnstile run --agent-command` on the embedded default: Claude Code runs once per sample against its
    sample's session; every trajectory ends COMPLETED (its agent exited 0), none FAILED."""
    from tests.test_cli import read_lines

    claude = cli("claude")
    out, home = tmp_path / "out.jsonl", tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    command = f"{claude} -p {{prompt}} --output-format json"
    argv = [sys.executable, "-m", "engine.cli", "run", "--agent-command", command, "--num-prompts", "2"]
    done = subprocess.run([*argv, "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_lines(out)
    assert [r["status"] for r in records] == ["completed", "completed"], [r.get("errors") for r in records]
    assert all(r["prompt_length"] > 1000 for r in records)  # Claude Code's own system prompt and tools: its request
