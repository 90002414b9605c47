"""Turns read by SGLang's own parsers, on real SGLang servers (CPU): every parser name SGLang registers is one the
settings take and the server reads with; the documented turns of every family the engine has a parser for are
read by the server as the engine reads them; and a run whose family only SGLang has gets each turn read by the
server, through the turn loop. Skips (fails under TURNSTILE_REQUIRE_SGLANG=1) without the SGLang venv."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from engine.backends.pool import BackendPool
from engine.backends.sglang import SGLangBackend
from engine.config import EngineConfig, Settings
from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine
from engine.envs.base import AsyncInteractionEnv, EnvRunner
from engine.errors import BackendError, ErrorClass
from engine.families import SGLANG_REASONING_PARSERS, SGLANG_TOOL_CALL_PARSERS
from engine.parsers import current_parser
from engine.parsers.base import ParsedTurn
from engine.parsers.read import ReadTurn
from engine.trajectory import Status
from engine.turn import TurnLimits
from tests.parser_outputs import DOCUMENTED, TOOLS
from tests.test_parsers_vs_sglang import REASONING_PARSERS, SGLANG_DIFFERS, reading, stripped

pytestmark = [pytest.mark.sglang, pytest.mark.anyio]

NAMES = (
    "from sglang.srt.function_call.parser_names import TOOL_CALL_PARSER_NAMES as t; "
    "from sglang.srt.parser.reasoning_parser_names import REASONING_PARSER_NAMES as r; "
    "import json; print(json.dumps([t, r]))"
)


def test_the_parser_names_are_the_installed_sglangs():
    from tests.sglang_cpu.server import is_installed, venv_dir, venv_python

    if not is_installed():
        reason = f"no SGLang venv at {venv_dir()}: run `python -m tests.sglang_cpu.server install`"
        if os.environ.get("TURNSTILE_REQUIRE_SGLANG") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(venv_python()), "-c", NAMES], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    tool_calls, reasoning = json.loads(done.stdout)
    assert (tool_calls, reasoning) == (list(SGLANG_TOOL_CALL_PARSERS), list(SGLANG_REASONING_PARSERS))


@pytest.fixture
async def servers(sglang_workers):
    """Both servers of the session as one pool: readings go to the less loaded."""
    async with BackendPool([SGLangBackend(server.url) for server in sglang_workers]) as pool:
        yield pool


KINDS = (("tool_call_parser", SGLANG_TOOL_CALL_PARSERS), ("reasoning_parser", SGLANG_REASONING_PARSERS))
# Names this server cannot read with, and why (each still fails, so the note goes when it no longer does).
CANNOT_READ_HERE = {
    **dict.fromkeys(
        ("beam", "glm47", "iquest_q1"),
        "SGLang 0.5.23's /parse_function_call hands these detectors its msgspec Tool, which lacks the pydantic "
        "fields they read (model_dump, function.strict): HTTP 500 in SGLang itself",
    ),
    **dict.fromkeys(
        ("deepseekv4", "deepseekv41", "deepseek-v4", "deepseek-v41"),
        "read with the model's own tokenizer: HTTP 400 from a server of another model",
    ),
    "response_template": "needs the server started with its response template: HTTP 500 without",
}


async def test_every_parser_name_sglang_has_reads_a_turn_on_its_server(servers):
    text = "The weather is fine."
    failed = {}
    for kind, names in KINDS:
        for name in names:
            Settings(url="http://127.0.0.1:1", **{"model_family" if kind == "tool_call_parser" else kind: name})
            parsers = {"tool_call_parser": None, "reasoning_parser": None, kind: name}
            try:
                turn = await read(servers, f"<think>Sunny.</think>{text}", parsers)
            except BackendError as exc:
                failed[name] = exc.message
                continue
            assert turn.tool_calls == (), (name, turn)
            if kind == "tool_call_parser":  # no call in it: the text is the content (reasoning formats differ)
                assert text in turn.content, (name, turn)
    assert failed.keys() == CANNOT_READ_HERE.keys(), failed


async def test_the_server_reads_every_documented_turn_as_the_engine_does(servers):
    """tests/parser_outputs.py's documented turns of the nine families, through `read_turn` (the prompt's
    `<think>` put back where it opened the reasoning, as ServerReader does)."""
    disagree = []
    for case in DOCUMENTED:
        text = "<think>" + case.text if case.in_reasoning and not case.text.startswith("<think>") else case.text
        names = {"tool_call_parser": case.family, "reasoning_parser": REASONING_PARSERS[case.family]}
        if case.family in CANNOT_READ_HERE:  # the engine reads these itself (turn_parser auto)
            with pytest.raises(BackendError, match="HTTP 500"):
                await read(servers, text, names)
            continue
        turn = await read(servers, text, names)
        calls = [{"name": call.name, "arguments": call.arguments} for call in turn.tool_calls]
        theirs = stripped({"reasoning": turn.reasoning, "content": turn.content, "calls": calls})
        if (theirs == reading(case)) == (case.id in SGLANG_DIFFERS):
            disagree.append(case.id)
    assert disagree == []


async def read(servers, text: str, names: dict) -> ParsedTurn:
    """One reading, tried again once where the connection was closed under it (as the engine's CONNECTION budget
    does): the server closes a kept-alive connection after its HTTP 500."""
    try:
        return await servers.read_turn(text, tools=TOOLS, **names)
    except BackendError as exc:
        if exc.error_class is not ErrorClass.CONNECTION:
            raise
    return await servers.read_turn(text, tools=TOOLS, **names)


IN_PROCESS = Path(__file__).parent / "sglang_cpu" / "read_in_process.py"
# Read in this process where the servers cannot (SGLang's 500 is in its HTTP handler, not in the detectors)
READ_ONLY_IN_PROCESS = ("beam", "glm47", "iquest_q1")
ON_THE_SERVERS = ("deepseekv4", "deepseekv41", "deepseek-v4", "deepseek-v41")  # read with the served model's encoding


def in_process(cases: list[dict], names: list[str]) -> dict:
    """The engine's in-process reader (InProcessParsers) on `cases`, run by the SGLang venv's python."""
    from tests.sglang_cpu.server import venv_python

    env = {key: value for key, value in os.environ.items() if key != "VIRTUAL_ENV"}
    env["PYTHONPATH"] = str(Path(__file__).parent.parent)
    asked = json.dumps({"cases": cases, "names": names})
    done = subprocess.run(
        [str(venv_python()), str(IN_PROCESS)], input=asked, capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


async def test_sglangs_parsers_in_process_read_every_turn_as_its_servers_do(servers):
    """Where `sglang` is importable (slime's image), SGLang's parser classes read the turns in the engine's process:
    every name and every documented turn as the servers read them, and the three names SGLang's endpoint fails on
    read too. The names read with the served model's own encoding stay on the servers."""
    cases = [
        {"text": "<think>Sunny.</think>The weather is fine.", "tools": TOOLS, "tool_call_parser": None,
         "reasoning_parser": None, kind: name}
        for kind, names in KINDS for name in names
    ] + [
        {"text": "<think>" + case.text if case.in_reasoning and not case.text.startswith("<think>") else case.text,
         "tools": TOOLS, "tool_call_parser": case.family, "reasoning_parser": REASONING_PARSERS[case.family]}
        for case in DOCUMENTED
    ]  # fmt: skip
    names = [*SGLANG_TOOL_CALL_PARSERS, *SGLANG_REASONING_PARSERS]
    answer = in_process(cases, names)
    assert {name for name, here in answer["here"].items() if not here} == set(ON_THE_SERVERS)
    differ = []
    for case, theirs in zip(cases, answer["readings"], strict=True):
        named = {key: case[key] for key in ("tool_call_parser", "reasoning_parser")}
        if case["tool_call_parser"] in READ_ONLY_IN_PROCESS:
            assert "error_class" not in theirs, (named, theirs)
            continue
        if {case["tool_call_parser"], case["reasoning_parser"]} & set(ON_THE_SERVERS):
            continue  # never read in process (above)
        try:
            turn = await read(servers, case["text"], named)
        except BackendError:
            ours = {"failed": True}
        else:
            calls = [{"name": call.name, "arguments": call.arguments} for call in turn.tool_calls]
            ours = {"reasoning": turn.reasoning, "content": turn.content, "calls": calls}
        if "error_class" in theirs:  # response_template's missing template: CLIENT here, HTTP 500 there
            theirs = {"failed": True}
        if ours != theirs:
            differ.append((named, case["text"][:60], ours, theirs))
    assert differ == [], "\n".join(map(str, differ))
    # glm47's documented turns, which the servers cannot read here, read in process as the engine reads them
    glm47 = [
        (case, theirs)
        for case, theirs in zip(DOCUMENTED, answer["readings"][len(names) :], strict=True)
        if case.family == "glm47"
    ]
    assert glm47 and all(stripped(theirs) == reading(case) for case, theirs in glm47)


class NotingEnv(AsyncInteractionEnv):
    """Three turns; notes the parser each step ran under, as env code's parse_tool_calls sees it."""

    def __init__(self):
        self.parsers: list[object] = []

    def reset(self):
        return {}, {}

    async def astep(self, response_text):
        self.parsers.append(current_parser())
        done = len(self.parsers) >= 3
        return {"role": "tool", "content": "sunny"}, done, {"reward": 1.0} if done else {}

    def format_observation(self, observation):
        return observation


async def test_a_family_only_sglang_has_is_read_turn_by_turn_by_the_server(sglang_workers, tokenizer):
    settings = Settings(url=sglang_workers[0].url, model_family="minimax-m2", reasoning_parser="minimax-append-think")
    encoder = ChatEncoder.for_settings(tokenizer, settings)
    envs: list[NotingEnv] = []

    def build(sample):
        envs.append(NotingEnv())
        return EnvRunner(envs[-1])

    rows = [{"prompt": [{"role": "user", "content": "Weather in Paris?"}], "label": ""}]
    config = EngineConfig(n_samples_per_prompt=2, limits=TurnLimits(max_turns=3), max_new_tokens=8)
    async with SGLangBackend(settings.url) as backend, RolloutEngine(
        backend=backend, encoder=encoder, env_factory=build, source=rows, config=config,
        reader=settings.server_reader(backend),
    ) as engine:  # fmt: skip
        [group] = await engine.rollout(1)
    for trajectory in group.trajectories:
        assert trajectory.status is Status.COMPLETED, trajectory.errors
        assert all(turn.reading is not None for turn in trajectory.turns)
    parsers = [parser for env in envs for parser in env.parsers]
    assert len(parsers) == 6 and all(isinstance(p, ReadTurn) and p.name == "minimax-m2" for p in parsers)
