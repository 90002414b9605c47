"""Turns read by SGLang's own parsers on its servers: every tool-call and reasoning parser name SGLang has is a
setting; one the engine has no parser for is read by the servers (`turn_parser`), and refused where there are
none; the env's `parse_tool_calls` gets the server's reading, a retried reading costs the backend's budget, and an
env replayed after a failure reads each earlier turn as it was read. The SGLang tier (tests/test_sglang_read.py)
runs the same against real servers."""

from __future__ import annotations

import importlib.util
import json

import httpx2
import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from engine.backends.sglang import SGLangBackend
from engine.config import EngineConfig, Settings
from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine
from engine.envs.base import AsyncInteractionEnv, EnvRunner
from engine.envs.tool_calls import Tool, parse_tool_calls
from engine.errors import BackendError, EnvError, ErrorClass
from engine.families import SGLANG_REASONING_PARSERS, SGLANG_TOOL_CALL_PARSERS, has_family
from engine.parsers import current_parser
from engine.parsers.base import ParsedTurn, ToolCallText
from engine.parsers.read import ReadTurn
from engine.scheduler.retry import RetryPolicy
from engine.trajectory import Status
from engine.turn import ServerReader, TurnLimits
from tests.fakes import DeterministicBackend

URL = "http://127.0.0.1:30000"


# -- settings ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SGLANG_TOOL_CALL_PARSERS)
def test_every_tool_call_parser_sglang_has_is_a_setting_read_by_the_engine_or_by_the_servers(name):
    settings = Settings(url=URL, model_family=name)
    if has_family(name):
        assert settings.server_parsers is None  # the engine's own parser, which agrees with SGLang's
    else:
        assert settings.server_parsers == (name, None)
        assert isinstance(settings.server_reader(object()), ServerReader)
        with pytest.raises(ValidationError, match=f"model_family {name}: read only by SGLang's own parsers"):
            Settings(model_family=name)  # the local backend has no SGLang to read it


@pytest.mark.parametrize("name", SGLANG_REASONING_PARSERS)
def test_every_reasoning_parser_sglang_has_is_a_setting(name):
    settings = Settings(url=URL, reasoning_parser=name)
    assert settings.reasoning_parser == name
    assert settings.server_parsers in (None, (None, name))


def test_parser_names_sglang_does_not_have_and_turn_parser_misuse_are_one_error_each():
    with pytest.raises(ValidationError, match="'minimax-m9': not a tool-call parser SGLang has"):
        Settings(url=URL, model_family="minimax-m9")
    with pytest.raises(ValidationError, match="'nemotron_9': not one SGLang has"):
        Settings(url=URL, reasoning_parser="nemotron_9")
    with pytest.raises(ValidationError, match="not by turn_parser engine"):
        Settings(url=URL, model_family="gemma4", turn_parser="engine")
    with pytest.raises(ValidationError, match="turn_parser sglang: needs SGLang servers"):
        Settings(model_family="qwen25", turn_parser="sglang")
    forced = Settings(url=URL, model_family="qwen25", reasoning_parser="qwen3", turn_parser="sglang")
    assert forced.server_parsers == ("qwen25", "qwen3")
    assert Settings(url=URL, model_family="qwen25", turn_parser="engine").server_parsers is None


# -- the backend's request and its reading of SGLang's reply ---------------------------------------------------


def sglang_transport(seen: list[tuple[str, dict]], replies: dict[str, httpx2.Response]) -> httpx2.MockTransport:
    def handle(request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        if path in replies:
            seen.append((path, json.loads(request.content or b"null")))
            return replies[path]
        return httpx2.Response(404, json={"detail": "Not Found"})  # no /workers: a server, not a router

    return httpx2.MockTransport(handle)


@pytest.mark.anyio
async def test_the_backend_asks_sglang_as_its_api_takes_it_and_reads_its_reply():
    seen: list[tuple[str, dict]] = []
    replies = {
        "/separate_reasoning": httpx2.Response(200, json={"reasoning_text": "weigh it", "text": "<call>"}),
        "/parse_function_call": httpx2.Response(
            200,
            json={
                "normal_text": "Checking.",
                "calls": [
                    {"tool_index": 0, "name": "get_weather", "parameters": '{"city": "Paris"}'},
                    {"tool_index": 1, "name": "now", "parameters": ""},
                ],
            },
        ),
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    async with SGLangBackend(URL, transport=sglang_transport(seen, replies)) as backend:
        turn = await backend.read_turn("<think>weigh it</think><call>", tools=tools, tool_call_parser="minimax-m2",
                                       reasoning_parser="minimax-append-think")  # fmt: skip
    assert turn == ParsedTurn(
        "Checking.", "weigh it", (ToolCallText("get_weather", {"city": "Paris"}), ToolCallText("now", {}))
    )
    assert seen == [
        ("/separate_reasoning", {"text": "<think>weigh it</think><call>", "reasoning_parser": "minimax-append-think"}),
        ("/parse_function_call", {"text": "<call>", "tools": tools, "tool_call_parser": "minimax-m2"}),
    ]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("reply", "error_class", "match"),
    [
        (httpx2.Response(400, json={"detail": "Unsupported parser"}), ErrorClass.CLIENT, "HTTP 400"),
        (httpx2.Response(503, text="overloaded"), ErrorClass.SERVER, "HTTP 503"),
        (httpx2.Response(200, json={"normal_text": "x"}), ErrorClass.MALFORMED, "no list of calls"),
        (httpx2.Response(200, json={"normal_text": "x", "calls": [{"name": "f", "parameters": "[1]"}]}),
         ErrorClass.MALFORMED, "an object of arguments"),
    ],
)  # fmt: skip
async def test_a_reply_sglang_did_not_give_as_its_api_says_is_a_classified_backend_error(reply, error_class, match):
    transport = sglang_transport([], {"/parse_function_call": reply})
    async with SGLangBackend(URL, transport=transport) as backend:
        with pytest.raises(BackendError, match=match) as raised:
            await backend.read_turn("text", tools=[], tool_call_parser="gemma4", reasoning_parser=None)
    assert raised.value.error_class is error_class


# -- the turn loop ----------------------------------------------------------------------------------------


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str


WEATHER = Tool("get_weather", "The weather in a city.", City, {"city": "Paris"})


class ReadingBackend(DeterministicBackend):
    """A backend whose servers read every turn as one call of get_weather; `failures` readings fail first."""

    def __init__(self, failures: list[BackendError]):
        super().__init__()
        self.read_failures, self.read = failures, []

    async def read_turn(self, text, *, tools, tool_call_parser, reasoning_parser):
        self.read.append((text, [t["function"]["name"] for t in tools], tool_call_parser, reasoning_parser))
        if text and self.read_failures:  # the check at start reads ""
            raise self.read_failures.pop(0)
        return ParsedTurn("", "thought", (ToolCallText("get_weather", {"city": f"city {len(self.read)}"}),))


class WeatherEnv(AsyncInteractionEnv):
    """Parses each reply's call as env code does; its second step fails once, retryably (a replay)."""

    replay_safe = True

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.parsers: list[object] = []
        self.steps, self.failed = 0, False

    def reset(self):
        self.steps = 0
        return {}, {}

    async def astep(self, response_text):
        self.parsers.append(current_parser())
        [call] = parse_tool_calls(response_text, [WEATHER])
        self.calls.append((call.name, call.arguments["city"]))
        self.steps += 1
        if self.steps == 2 and not self.failed:
            self.failed = True
            raise EnvError(ErrorClass.ENV_EXCEPTION, "the weather service hung up")
        done = self.steps >= 4
        return {"role": "tool", "content": "sunny"}, done, {"reward": 1.0} if done else {}

    def format_observation(self, observation):
        return observation


@pytest.mark.anyio
async def test_the_env_parses_what_the_server_read_and_a_replay_reads_each_turn_as_it_was_read(tokenizer):
    encoder = ChatEncoder(tokenizer).for_tools([WEATHER.schema()])
    backend = ReadingBackend(failures=[BackendError(ErrorClass.SERVER, "HTTP 503")])
    env = WeatherEnv()
    row = {"prompt": [{"role": "user", "content": "Weather?"}], "label": ""}
    settings = EngineConfig(
        n_samples_per_prompt=1, retry=RetryPolicy(backoff_base_s=0.0), limits=TurnLimits(max_turns=4)
    )
    reader = ServerReader(backend, "minimax-m2", "minimax-append-think")
    async with RolloutEngine(
        backend=backend, encoder=encoder, env_factory=lambda sample: EnvRunner(env), source=[row],
        config=settings, reader=reader,
    ) as engine:  # fmt: skip
        [group] = await engine.rollout(1)
    [trajectory] = group.trajectories
    assert trajectory.status is Status.COMPLETED, trajectory.errors
    # the check at start, a failed reading retried, then one reading a turn: the replay read nothing again
    assert [names for _, names, *_ in backend.read] == [[]] + [["get_weather"]] * 5
    assert {(tool_calls, reasoning) for *_, tool_calls, reasoning in backend.read} == {
        ("minimax-m2", "minimax-append-think")
    }
    assert trajectory.turns[0].retries == 1  # the reading's retry, charged to the turn
    # turn 2's step failed and was replayed on a fresh reset: turn 1 again, read as it was the first time
    assert env.calls == [("get_weather", f"city {n}") for n in (3, 4, 3, 4, 5, 6)]
    assert all(isinstance(p, ReadTurn) and p.name == "minimax-m2" and p.fallback.name == "qwen25" for p in env.parsers)
    assert [turn.reading.reasoning for turn in trajectory.turns] == ["thought"] * 4
    assert "reading" not in trajectory.turns[0].to_record()


def test_a_read_turn_travels_to_env_workers_whole():
    """Ray env workers get the parser by value where the server read the turn (engine/envs/ray_workers.py)."""
    import pickle

    read = ReadTurn("gemma4", "text", ParsedTurn("", "r", (ToolCallText("f", {"a": [1]}),)), fallback=None)
    assert pickle.loads(pickle.dumps(read)) == read
    assert read.format_call("f", {}) == "" and read.parse("text") is read.turn
    with pytest.raises(ValueError, match="read this turn's text only"):
        read.parse("other text")


@pytest.mark.anyio
async def test_a_server_that_cannot_read_with_a_parser_is_one_error_at_start(tokenizer):
    """An SGLang without the parser (or one whose parser fails there) stops the run before any trajectory."""
    replies = {
        "/model_info": httpx2.Response(200, json={"weight_version": "default"}),
        "/parse_function_call": httpx2.Response(500, text="Internal Server Error"),
    }
    transport = sglang_transport([], replies)
    async with SGLangBackend(URL, transport=transport) as backend:
        engine = RolloutEngine(
            backend=backend, encoder=ChatEncoder(tokenizer), config=EngineConfig(),
            reader=ServerReader(backend, "beam", None),
        )  # fmt: skip
        with pytest.raises(BackendError, match=r"HTTP 500.*SGLang cannot read turns with tool-call parser 'beam'"):
            async with engine:
                pass


def test_agent_envs_and_the_gateway_refuse_turns_read_by_sglang(tokenizer):
    """An agent's replies stream through the session gateway, read there by the engine's own parsers: a run whose
    turns SGLang reads is refused by the agent envs' settings, and by a Gateway on such a scheduler."""
    from engine.agents.gateway import Gateway

    with pytest.raises(ValidationError, match="env engine.envs.agent_command: its agent's replies are read by"):
        Settings(url=URL, agent_command="claude -p {prompt}", model_family="kimi_k3")
    engine = RolloutEngine(
        backend=DeterministicBackend(), encoder=ChatEncoder(tokenizer), reader=ServerReader(object(), "kimi_k3", None)
    )
    with pytest.raises(ValueError, match="SGLang's 'kimi_k3'"):
        Gateway(engine.scheduler)


@pytest.mark.anyio
async def test_where_sglang_is_importable_here_its_parsers_read_in_process_and_the_servers_are_not_asked():
    """The choice and the route; SGLang's real classes in process are the SGLang tier's (tests/test_sglang_read.py)."""
    asked = []

    class Here:
        async def read_turn(self, text, **names):
            asked.append((text, names["tool_call_parser"]))
            return ParsedTurn(text, "")

    class Servers:
        async def read_turn(self, text, **names):
            raise AssertionError("the servers were asked")

    reader = ServerReader(Servers(), "gemma4", None, in_process=Here())
    await reader.check()
    assert asked == [("", "gemma4")] and reader.where == "in this process"
    if importlib.util.find_spec("sglang") is None:  # this venv: the servers read
        assert Settings(url=URL, model_family="gemma4").server_reader(Servers()).where == "on the servers"
