"""`turnstile gateway` as a user starts it: a standing server over SGLang (an SGLang double scripted with the
policy's tokens: a tool call, then text), bound to 127.0.0.1, printing its URLs and key; sessions opened on first
use and by `POST /sessions`, each with its key; a session finished by `POST .../finish`; Ctrl-C finishing the
rest, its last line counting what it wrote; the JSON lines `turnstile show` reads."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import anthropic
import httpx2
import openai
import pytest

from engine.models import load_tokenizer
from tests.agents.program import TOOLS
from tests.sglang_double import Generate, SGLangDouble
from tests.test_cli import read_lines, turnstile

pytestmark = pytest.mark.slow
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def tokens(text: str) -> list[int]:
    tokenizer = load_tokenizer("qwen2.5")
    return [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.convert_tokens_to_ids("<|im_end|>")]


@contextlib.contextmanager
def gateway(*argv: str) -> Iterator[subprocess.Popen]:
    """`turnstile gateway ARGV` as a terminal starts it; killed at the end if it is still running."""
    proc = turnstile("gateway", *argv)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def interrupt(proc: subprocess.Popen) -> str:
    """Ctrl-C, and what the process said on stderr once it ended."""
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=120)[1]


def started(proc: subprocess.Popen) -> dict[str, str]:
    """What the gateway printed as it started: its URL, its key and the example's base URLs."""
    said: list[str] = []
    for line in proc.stderr:
        said.append(line)
        if line.lstrip().startswith("finished sessions' chains"):
            break
    text = "".join(said)
    found = {
        "url": re.search(r"serving at (http://127\.0\.0\.1:\d+)", text),
        "key": re.search(r"key: (\S+)", text),
        "openai": re.search(r"OpenAI \(Chat Completions, Responses\) base URL: (\S+)", text),
        "anthropic": re.search(r"Anthropic \(Messages\) base URL: +(\S+)", text),
    }
    assert all(found.values()), text
    return {name: match[1] for name, match in found.items()}


def test_the_gateway_command_serves_sessions_and_writes_each_finished_one(tmp_path):
    out = tmp_path / "sessions.jsonl"
    with SGLangDouble() as server:
        server.script(
            Generate(token_ids=tokens(CALL)), Generate(token_ids=tokens("It is sunny in Paris.")),
            Generate(token_ids=tokens("Hello.")),
        )  # fmt: skip
        with gateway("--url", server.url, "--tokenizer", "qwen2.5", "--port", "0", "--out", str(out)) as proc:
            served = started(proc)
            assert served["openai"].startswith(served["url"]) and served["openai"].endswith("/sessions/demo/v1")
            # a session opened by its first request (the gateway's key), any name in the URL
            base = served["openai"].replace("/demo/", "/weather/")
            with openai.OpenAI(base_url=base, api_key=served["key"], max_retries=0) as agent:
                messages = [{"role": "user", "content": "How is the weather in Paris?"}]
                first = agent.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True)
                calls = [c for chunk in first if chunk.choices for c in chunk.choices[0].delta.tool_calls or ()]
                assert [c.function.name for c in calls] == ["get_weather"]
                call = {"id": calls[0].id, "type": "function", "function": calls[0].function.model_dump()}
                messages += [
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny, 24 C."},
                ]
                second = agent.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
                assert second.choices[0].message.content == "It is sunny in Paris."
            with httpx2.Client(base_url=served["url"], timeout=60) as http:
                wrong = http.post("/sessions/weather/v1/chat/completions", json={}, headers={"x-api-key": "sk-guess"})
                assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
                assert wrong.headers["x-should-retry"] == "false"  # the SDKs' retries would not change it
                finished = http.post("/sessions/weather/finish", headers={"x-api-key": served["key"]}).json()
                assert finished == {"id": "weather", "chains": 1, "statuses": {"completed": 1}, "forks": {}}
                opened = http.post("/sessions", headers={"Authorization": f"Bearer {served['key']}"}).json()
            # a session opened by the endpoint, reached with its own key
            with anthropic.Anthropic(base_url=opened["anthropic_base_url"], api_key=opened["key"], max_retries=0) as a:
                reply = a.messages.create(model="policy", max_tokens=64, messages=[{"role": "user", "content": "Hi"}])
                assert reply.content[0].text == "Hello."
            err = interrupt(proc)  # the open session is finished and written
    assert proc.returncode == 0 and "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert last == f"turnstile: stopped; 2 sessions finished, 2 chains {{'completed': 2}} written to {out}", err
    records = read_lines(out)
    assert [r["metadata"]["session_id"] for r in records] == ["weather", opened["id"]]
    weather = records[0]
    assert weather["status"] == "completed" and len(weather["turns"]) == 2
    assert sum(weather["loss_mask"]) == len(tokens(CALL)) + len(tokens("It is sunny in Paris."))
    shown = subprocess.run(
        [sys.executable, "-m", "engine.cli", "show", str(out), "--id", str(weather["id"])],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "Sunny, 24 C." in shown.stdout and "get_weather" in shown.stdout


def test_the_gateway_command_refuses_what_it_does_not_read_and_a_dead_url(tmp_path):
    argv, out = [sys.executable, "-m", "engine.cli", "gateway"], str(tmp_path / "x.jsonl")
    flag = subprocess.run([*argv, "--env", "python_tool", "--out", out], capture_output=True, text=True, timeout=120)
    assert flag.returncode == 2 and "unrecognized arguments: --env python_tool" in flag.stderr, flag.stderr
    (tmp_path / "gateway.yaml").write_text("env_path: python_tool\n")
    yaml = subprocess.run(
        [*argv, "--config", str(tmp_path / "gateway.yaml"), "--out", out], capture_output=True, text=True, timeout=120
    )
    said = "turnstile: error: env_path: not read by `turnstile gateway` (its agents make the turns)"
    assert yaml.returncode == 2 and yaml.stderr.strip().splitlines()[-1] == said, yaml.stderr
    dead = subprocess.run(
        [*argv, "--url", "http://127.0.0.1:9", "--out", out], capture_output=True, text=True, timeout=120
    )
    assert dead.returncode == 2 and "unreachable" in dead.stderr, dead.stderr
