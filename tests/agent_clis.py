"""TEST INFRASTRUCTURE: the agent CLIs people train, from npm, unmodified, for tests/test_agent_clis.py.

    python -m tests.agent_clis install    # npm install of the pinned versions (cached; ~300 MB, a minute once)

Claude Code (`@anthropic-ai/claude-code`, a native binary in its platform package) and Codex (`@openai/codex`, a
static binary in its platform package) at PINS, installed under $TURNSTILE_AGENT_CLIS, else `<turnstile
cache>/agent-clis`. A finished install leaves a marker naming the pins, so a half-done one is redone rather than
used. Neither needs a login or the network at run time: each is pointed at a session of the gateway by its
environment (Claude Code) or its config file (Codex), as `turnstile gateway` prints them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from engine.models import cache_dir

PINS = {"@anthropic-ai/claude-code": "2.1.328", "@openai/codex": "0.169.0"}
BINARIES = {"claude": "claude", "codex": "codex"}  # under node_modules/.bin


class AgentClisUnavailable(RuntimeError):
    """npm or the pinned CLIs are missing; the message says which and how to get them."""


def install_dir() -> Path:
    return Path(os.environ.get("TURNSTILE_AGENT_CLIS") or cache_dir() / "agent-clis")


def _marker() -> Path:
    tag = hashlib.sha256(json.dumps(PINS, sort_keys=True).encode()).hexdigest()[:12]
    return install_dir() / f".turnstile-agent-clis-{tag}"


def binary(name: str) -> Path:
    """The installed CLI `name` ("claude" or "codex"); AgentClisUnavailable when it is not installed."""
    path = install_dir() / "node_modules" / ".bin" / BINARIES[name]
    if not (_marker().exists() and path.exists()):
        raise AgentClisUnavailable(
            f"no {name} CLI at {path}: run `python -m tests.agent_clis install` (npm install of {PINS})"
        )
    return path


def install(log=sys.stderr) -> Path:
    """npm install PINS into the cache, unless done already; AgentClisUnavailable with npm's last lines."""
    if _marker().exists():
        return install_dir()
    npm = shutil.which("npm")
    if npm is None:
        raise AgentClisUnavailable("npm is not on PATH: install Node.js 18 or newer (`apt-get install nodejs npm`)")
    shutil.rmtree(install_dir(), ignore_errors=True)
    install_dir().mkdir(parents=True)
    step = [npm, "install", "--no-audit", "--no-fund", "--prefix", str(install_dir())]
    step += [f"{name}@{version}" for name, version in PINS.items()]
    print(f"agent-clis: {' '.join(step[1:])}", file=log, flush=True)
    done = subprocess.run(step, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise AgentClisUnavailable(f"npm install failed:\n{tail}")
    for name in BINARIES:
        version = subprocess.run(
            [str(install_dir() / "node_modules" / ".bin" / BINARIES[name]), "--version"], capture_output=True, text=True
        )
        if version.returncode != 0:
            raise AgentClisUnavailable(f"the installed {name} does not run: {version.stderr.strip()[-500:]}")
        print(f"agent-clis: {name} {version.stdout.strip()}", file=log, flush=True)
    _marker().write_text(json.dumps(PINS))
    return install_dir()


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python -m tests.agent_clis install")
    try:
        print(install())
    except AgentClisUnavailable as exc:
        sys.exit(f"agent-clis: {exc}")
