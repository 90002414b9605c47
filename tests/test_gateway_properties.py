"""Whatever a client sends, the gateway answers in the API's own terms: a reply in the API's shape, or a 4xx
whose body is the API's JSON error (before a stream, or as its error event), never a 5xx nor a plain-text error;
and it goes on serving. Checked over bodies built from the real shapes of each API (Chat Completions, Responses,
Messages): a hostile value put in a field where one does harm (images that are no data URL or are cut short, tool
schemas and call arguments nested deep, call ids of the wrong type, a new message without content, huge
strings), then fields mutated at random (wrong types, deleted, unknown types and roles, duplicated, lone
surrogates, numbers past any range), streamed and not; some bodies are not JSON or not an object, and some come
with a wrong key or none.

One gateway per test, serving in a thread of its own (a blocking portal), over a vision policy (images are
read, not refused outright) that answers every prompt. Each example has a session of its own, where it first
asks the question that the requests going on from it continue (their new messages an observation).
"""

from __future__ import annotations

import base64
import copy
import functools
import io
import json
import operator
import random
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anthropic.types
import anyio.from_thread
import httpx2
import openai.types.chat
import openai.types.responses
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from pydantic import TypeAdapter

from engine.encoding import ChatEncoder
from engine.families import family_named
from tests.agents.program import TOOLS
from tests.fakes import ScriptedBackend
from tests.gateway_kit import CALL, PROMPT, gateway_over, sampled

EXAMPLES = 150  # per API, each one or two requests to the live gateway
PATHS = {"chat": "v1/chat/completions", "responses": "v1/responses", "messages": "v1/messages"}


@pytest.fixture(scope="module")
def vision(processor):
    # Qwen2.5-VL's template writes no tool calls: its family is named, as `--model-family qwen25` does (and as
    # the embedded default's settings do)
    return ChatEncoder(processor.tokenizer, processor=processor, family=family_named("qwen25"))


def picture(width: int = 8, height: int = 8, kind: str = "PNG", *, noise: bool = False) -> str:
    """An image in base64: one colour, or noise (which compresses to little, so that a cut falls in its pixels)."""
    pixels = random.Random(0).randbytes(width * height * 3) if noise else bytes([200, 30, 30]) * (width * height)
    buffer = io.BytesIO()
    Image.frombytes("RGB", (width, height), pixels).save(buffer, format=kind)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def cut(image: str) -> str:
    """The image's first two thirds: its header reads, its pixels do not."""
    data = base64.b64decode(image)
    return base64.b64encode(data[: len(data) * 2 // 3]).decode("ascii")


PNG = picture()
DATA_URL = f"data:image/png;base64,{PNG}"

# -- valid requests of each API, the seeds of the mutations ------------------------------------------------

ASKED = PROMPT[1]
CALLED = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CHAT = [
    {"model": "p", "messages": PROMPT},
    {"model": "p", "messages": PROMPT, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 64, "stop": ["\n\n"]},
    {"model": "p", "messages": [*PROMPT, {"role": "assistant", "content": None, "tool_calls": [CALLED]},
                                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."}], "tools": TOOLS},
    {"model": "p", "messages": [*PROMPT, {"role": "assistant", "content": "", "tool_calls": [CALLED, CALLED]},
                                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
                                {"role": "tool", "tool_call_id": "call_1", "content": "Rain."}], "tools": TOOLS},
    {"model": "p", "messages": [*PROMPT, {"role": "tool", "tool_call_id": "call_9", "content": "No call."}]},
    {"model": "p", "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": DATA_URL}}, {"type": "text", "text": "What is this?"}]}]},
    {"model": "p", "messages": [*PROMPT, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look."},
                                {"role": "user", "content": [{"type": "text", "text": "And?"}]}],
     "stream_options": {"include_usage": True}, "temperature": 0.3, "n": 1},
    {"model": "p", "messages": [*PROMPT, {"role": "function", "name": "get_weather", "content": "Sunny."}]},
]  # fmt: skip
RESPONSES = [
    {"model": "p", "input": "How is the weather in Paris?", "instructions": "Answer briefly."},
    {"model": "p", "input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": DATA_URL}]}]},
    {"model": "p", "tools": [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]
                              ["parameters"]}, {"type": "web_search"}], "max_output_tokens": 64, "input": [
        {"type": "message", "role": "user", "content": "Paris?"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Look it up."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny."}]},
    {"model": "p", "tools": [{"type": "custom", "name": "shell", "format": {"type": "grammar", "syntax": "lark",
        "definition": "start: /.+/"}}, {"type": "namespace", "name": "fs", "tools": [
        {"type": "function", "name": "read", "parameters": {"type": "object"}}]},
        {"type": "tool_search", "execution": "client"}], "input": [
        {"type": "message", "role": "developer", "content": "Use the shell."},
        {"type": "message", "role": "user", "content": "List it."},
        {"type": "custom_tool_call", "call_id": "c2", "name": "shell", "input": "ls"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "a b"}]}]},
    {"model": "p", "input": [{"type": "message", "role": "user", "content": "Hi"},
                             {"type": "function_call_output", "call_id": "none", "output": "orphan"}]},
    {"model": "p", "input": [{"type": "message", "role": "user", "content": "Hi"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny."},
        {"type": "web_search_call", "id": "ws1", "status": "completed"}]},
    {"model": "p", "instructions": PROMPT[0]["content"], "input": [
        {"type": "message", "role": "user", "content": ASKED["content"]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Look."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And?"}]}]},
]  # fmt: skip
MESSAGES = [
    {"model": "p", "max_tokens": 64, "system": PROMPT[0]["content"], "messages": [ASKED]},
    {"model": "p", "max_tokens": 64, "system": [{"type": "text", "text": "Look."}], "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                   "data": PNG}},
                                     {"type": "document", "source": {"type": "text", "data": "A note."}},
                                     {"type": "text", "text": "What is this?"}]}]},
    {"model": "p", "max_tokens": 64, "stop_sequences": ["END"], "tools": [
        {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]},
        {"type": "bash_20250124", "name": "bash"}, {"type": "web_search_20250305", "name": "web_search"}],
     "messages": [ASKED, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Look it up.", "signature": "x"},
        {"type": "tool_use", "id": "tu1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": "Sunny."}]}]},
    {"model": "p", "max_tokens": 64, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nowhere", "content": "orphan"}]}]},
    {"model": "p", "max_tokens": 64, "messages": [ASKED, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "tu1", "name": "get_weather", "input": {}},
        {"type": "tool_use", "id": "tu1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "is_error": True,
                                      "content": [{"type": "text", "text": "down"}]}]}],
     "temperature": 0.5, "tool_choice": {"type": "auto"}},
    {"model": "p", "max_tokens": 64, "messages": [{"role": "system", "content": "Be brief."}, ASKED]},
    {"model": "p", "max_tokens": 64, "system": PROMPT[0]["content"], "messages": [ASKED, {"role": "assistant",
        "content": [{"type": "thinking", "thinking": "Look.", "signature": "x"}, {"type": "text", "text": "Sunny."}]},
        {"role": "user", "content": [{"type": "text", "text": "And?"}]}]},
]  # fmt: skip
# what each example sends first (but for a wrong key): the chain that the bases going on from it continue
WARM_UP = {
    "chat": CHAT[0],
    "responses": {
        "model": "p",
        "instructions": PROMPT[0]["content"],
        "input": [{"type": "message", "role": "user", "content": ASKED["content"]}],
    },
    "messages": MESSAGES[0],
}
BASES = {"chat": CHAT, "responses": RESPONSES, "messages": MESSAGES}

# -- what goes in a field --------------------------------------------------------------------------------


def nested(depth: int, kind: str) -> str:
    """JSON nested `depth` levels deep (a list in a list..., or a schema's properties), as its text: written by
    hand, so that no recursion of this process's bounds how deep it goes."""
    if kind == "list":
        return "[" * depth + '"leaf"' + "]" * depth
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


DEEP = "\x00deep:"  # a string that stands for the nest it names (`nested`), put in when the body is encoded
ABSENT = "\x00absent"  # a field left out
UNDECODABLE = [  # images whose header reads (their size is known) but whose pixels do not, or that no processor takes
    cut(picture(32, 32, noise=True)), cut(picture(32, 32, "JPEG", noise=True)), cut(picture(32, 32, "BMP")),
    picture(1, 300),
]  # fmt: skip
NOT_IMAGE_DATA = [  # base64 that is no image the policy can take
    *UNDECODABLE, *UNDECODABLE, PNG[:-7], PNG[:40], "@@@", "", base64.b64encode(b"not an image").decode(),
]  # fmt: skip
NOT_IMAGES = [
    "http://169.254.169.254/latest/meta-data.png", "file:///etc/passwd", "/etc/passwd", "",
    "data:text/plain;base64,aGVsbG8=", "data:image/png," + PNG, *(f"data:image/png;base64,{d}" for d in NOT_IMAGE_DATA),
]  # fmt: skip
TAGS = [
    "bogus", "", "user", "assistant", "system", "tool", "function", "developer", "image", "image_url", "input_image",
    "tool_use", "tool_result", "thinking", "redacted_thinking", "server_tool_use", "document", "text", "input_text",
    "message", "reasoning", "function_call", "function_call_output", "custom_tool_call", "tool_search_call",
    "local_shell_call_output", "item_reference", "compaction", "namespace", "custom", "web_search", "mcp",
    "base64", "url", None, 7, 1.5, True,
]  # fmt: skip
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 2**31, 2**63, 2**64 + 1, 10**30, 1e308, -1e308, 5e-324, 0.5]),
    st.text(max_size=12), st.sampled_from(["\ud800", "a\udc80b", "\udfff\ud800", "\x00", "\u202e"]),
)  # fmt: skip
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=3),
    st.dictionaries(st.sampled_from(["type", "text", "id", "role", "content", "x"]), SCALARS, max_size=3),
    st.sampled_from(NOT_IMAGES + [DATA_URL]),
    st.sampled_from(TAGS),
    st.builds(lambda tag: [tag], st.sampled_from(TAGS)),
)  # fmt: skip


def places(value: Any, depth: int = 0) -> Iterator[tuple[Any, Any]]:
    """Every (container, key) of a body below its top level, to some depth."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items if depth <= 8 else ():
        yield from places(child, depth + 1)
        if depth > 0:
            yield value, key


# either side of each bound (the gateway's, a template's recursion, orjson's 1,024 levels); the first is drawn most
NESTS = st.builds(
    lambda n, kind: f"{DEEP}{n}:{kind}",
    st.sampled_from([700, 2, 60, 100, 300, 500, 800, 900, 1100]),
    st.sampled_from(["list", "dict"]),
)
PARSED_NESTS = st.builds(lambda n: f"{DEEP}{n}:list", st.sampled_from([700, 800, 900, 600, 500, 300, 1000]))
HUGE = st.builds(
    lambda n, c: c * n, st.sampled_from([10_000, 400_000]), st.sampled_from(["x", "é", "\n", "<|im_end|>"])
)
# a field's odd value: left out, a nest, or any other (drawn by kind: a one_of would flatten the nests away)
ODD = st.sampled_from([st.just(ABSENT), NESTS, NESTS, NESTS, VALUES, VALUES]).flatmap(lambda values: values)
IDS = st.one_of(st.sampled_from(["call_1", "c1", "tu1", "c2", "", "get_weather", "{", "{}"]), VALUES)
# the fields where the hostile values that need one land: (the base request, the field's path, what goes there)
SLOTS = {
    "chat": [
        (5, ("messages", 1, "content", 0, "image_url", "url"), st.sampled_from(NOT_IMAGES)),
        (5, ("messages", 1, "content", 0, "image_url"), st.sampled_from(NOT_IMAGES)),
        (2, ("messages", 2, "tool_calls", 0, "function", "arguments"), ODD),
        (2, ("messages", 2, "tool_calls", 0, "function", "arguments"), PARSED_NESTS),
        (1, ("tools", 0, "function", "parameters"), ODD),
        (0, ("messages", 1, "name"), ODD),
        (2, ("messages", 3, "tool_call_id"), IDS),
        (2, ("messages", 2, "tool_calls", 0, "id"), IDS),
        (0, ("messages", 1, "content"), HUGE),
        (6, ("messages", 3, "content"), ODD),
        (6, ("messages", 3, "content"), st.just(ABSENT)),
        (6, ("messages", 3, "content", 0, "text"), ODD),
        (6, ("messages", 3, "role"), st.sampled_from(TAGS)),
    ],
    "responses": [
        (1, ("input", 0, "content", 1, "image_url"), st.sampled_from(NOT_IMAGES)),
        (2, ("input", 2, "arguments"), ODD),
        (2, ("input", 2, "arguments"), PARSED_NESTS),
        (3, ("input", 2, "input"), ODD),
        (2, ("tools", 0, "parameters"), ODD),
        (2, ("input", 3, "call_id"), IDS),
        (3, ("input", 3, "output"), ODD),
        (0, ("input",), HUGE),
        (6, ("input", 3, "content"), ODD),
        (6, ("input", 3, "content"), st.just(ABSENT)),
        (6, ("input", 3, "content", 0), ODD),
        (6, ("input", 3, "role"), st.sampled_from(TAGS)),
    ],
    "messages": [
        (1, ("messages", 0, "content", 0, "source", "data"), st.sampled_from(NOT_IMAGE_DATA)),
        (1, ("messages", 0, "content", 0, "source", "media_type"), st.one_of(st.sampled_from(TAGS), SCALARS)),
        (2, ("messages", 1, "content", 1, "input"), ODD),
        (2, ("messages", 1, "content", 1, "input"), PARSED_NESTS),
        (2, ("tools", 0, "input_schema"), ODD),
        (2, ("messages", 2, "content", 0, "tool_use_id"), IDS),
        (2, ("messages", 2, "content", 0, "content"), ODD),
        (0, ("messages", 0, "content"), HUGE),
        (6, ("messages", 2, "content"), ODD),
        (6, ("messages", 2, "content"), st.just(ABSENT)),
        (6, ("messages", 2, "content", 0), ODD),
        (6, ("messages", 2, "content", 0, "type"), st.sampled_from(TAGS)),
    ],
}


def put(container: Any, key: Any, value: Any) -> None:
    if value == ABSENT and isinstance(container, dict):
        container.pop(key, None)
    else:
        container[key] = value


@st.composite
def bodies(draw: st.DrawFn, api: str) -> bytes:
    """A request's body: a valid one of the API with a hostile value in one of its fields and some fields
    mutated at random, then encoded (or not JSON at all)."""
    form = draw(st.sampled_from(["json"] * 12 + ["raw", "not_object", "truncated"]))
    if form == "raw":
        return draw(st.binary(max_size=64))
    if form == "not_object":
        return draw(st.sampled_from([b"[]", b"null", b"1", b'"x"', b"true", b"[{}]", b"1e999", b"{}", b"{" * 5000]))
    slotted = draw(st.sampled_from([True, True, True, True, False]))
    if slotted:
        base, path, values = draw(st.sampled_from(SLOTS[api]))
        body = copy.deepcopy(BASES[api][base])
        *where, last = path
        place = functools.reduce(operator.getitem, where, body)
        put(place, last, draw(values))
    else:
        body = copy.deepcopy(draw(st.sampled_from(BASES[api])))
    body["stream"] = draw(st.booleans())
    for _ in range(draw(st.sampled_from([0, 0, 0, 1] if slotted else [0, 1, 1, 2, 3]))):
        container, key = draw(st.sampled_from([*places(body), *((body, key) for key in body)]))
        operation = draw(st.sampled_from(["replace", "replace", "delete", "retag", "add", "duplicate"]))
        if operation == "replace" or not isinstance(container, dict) and operation in ("delete", "retag", "add"):
            put(container, key, draw(ODD))
        elif operation == "delete":
            del container[key]
        elif operation == "retag":
            container[draw(st.sampled_from(["type", "role"]))] = draw(st.sampled_from(TAGS))
        elif operation == "add":
            container[draw(st.sampled_from(["type", "role", "id", "tool_call_id", "call_id", "zz"]))] = draw(VALUES)
        elif isinstance(container, list):
            container.insert(key, copy.deepcopy(container[key]))
        else:
            container[f"{key}_again"] = copy.deepcopy(container[key])
    text = json.dumps(body, ensure_ascii=draw(st.booleans()))
    text = re.sub(rf'"{re.escape(json.dumps(DEEP)[1:-1])}(\d+):(\w+)"', lambda m: nested(int(m[1]), m[2]), text)
    data = text.encode("utf-8", "surrogatepass")
    return data[: draw(st.integers(0, len(data)))] if form == "truncated" else data


# -- the live gateway --------------------------------------------------------------------------------------


class Policy(ScriptedBackend):
    """The warm-up's question answered with reasoning and "Sunny." (which the bases going on from it hold, so
    that they continue its chain: their new messages an observation); any other prompt with one of `REPLIES`
    chosen by its tokens, so that an example sent again is answered again as it was."""

    def __init__(self, encoder: ChatEncoder):
        super().__init__([])
        self.tokenizer, self.answers = encoder.tokenizer, [sampled(encoder, text) for text in REPLIES]

    async def generate(self, input_ids, sampling_params, image_data=None, **options):
        asked = self.tokenizer.decode(input_ids[-24:]).endswith(
            f"{ASKED['content']}<|im_end|>\n<|im_start|>assistant\n"
        )
        self.replies = [self.answers[0 if asked else hash(tuple(input_ids)) % len(self.answers)]]
        return await super().generate(input_ids, sampling_params, image_data, **options)


REPLIES = ["<think>Look.</think>Sunny.", "Sunny.", CALL, "<tool_call>{"]


class Live:
    """A gateway serving in a thread of its own, and an HTTP client for it."""

    def __init__(self, gateway: Any, portal: anyio.from_thread.BlockingPortal, http: httpx2.Client):
        self.gateway, self.portal, self.http = gateway, portal, http

    def session(self) -> Any:
        return self.portal.call(self.gateway.open_session)

    def post(self, api: str, body: bytes, *, session: Any, key: str | None) -> tuple[int, str, str]:
        """(status, content type, text) of a request, its stream read whole."""
        # a connection each: on one kept alive, a reply's body can wait on Nagle's algorithm for the client's
        # delayed ACK (about 40 ms a request)
        headers = {"Content-Type": "application/json", "Connection": "close"}
        if key is not None:
            headers["x-api-key" if api == "messages" else "Authorization"] = (
                key if api == "messages" else f"Bearer {key}"
            )
        url = f"/sessions/{session.id}/{PATHS[api]}"
        with self.http.stream("POST", url, content=body, headers=headers) as reply:
            text = reply.read().decode("utf-8", "replace")
            return reply.status_code, reply.headers.get("content-type", ""), text


@contextmanager
def recursion_limit(limit: int) -> Iterator[None]:
    """Python's recursion limit, process-wide, as deployed: Hypothesis raises it while it runs an example, and the
    gateway's thread shares it (a template that recursed past it would pass here and fail in production)."""
    raised = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        yield
    finally:
        sys.setrecursionlimit(raised)


@contextmanager
def live_gateway(encoder: ChatEncoder) -> Iterator[Live]:
    gateway, _ = gateway_over(encoder, [], gc_freeze=False)
    gateway.scheduler.backend = Policy(encoder)
    with (
        anyio.from_thread.start_blocking_portal() as portal,
        portal.wrap_async_context_manager(gateway.serving()),
        httpx2.Client(base_url=gateway.url, timeout=60) as http,
    ):
        yield Live(gateway, portal, http)


def check_error(api: str, status: int, kind: str, text: str) -> None:
    """A 4xx whose body is the API's JSON error."""
    assert 400 <= status < 500 and kind.startswith("application/json"), (status, kind, text[:500])
    error = json.loads(text)
    if api == "messages":
        assert error["type"] == "error" and set(error) == {"type", "error"}, error
        assert isinstance(error["error"]["type"], str) and isinstance(error["error"]["message"], str), error
    else:
        assert isinstance(error["error"]["type"], str) and isinstance(error["error"]["message"], str), error


REPLY_MODELS = {
    "chat": openai.types.chat.ChatCompletion,
    "responses": openai.types.responses.Response,
    "messages": anthropic.types.Message,
}
EVENTS = {
    "chat": TypeAdapter(openai.types.chat.ChatCompletionChunk),
    "responses": TypeAdapter(openai.types.responses.ResponseStreamEvent),
    "messages": TypeAdapter(anthropic.types.RawMessageStreamEvent),
}
LAST_EVENTS = {
    "responses": ("response.completed", "response.incomplete", "response.failed"),
    "messages": ("message_stop",),
}


SERVER_ERRORS = ("server_error", "api_error", "overloaded_error")  # the gateway's own failure, in each API's words


def check_stream(api: str, text: str) -> None:
    """Server-sent events in the API's shape, ending as the API ends a stream, or with its error event for an
    error that is the request's (not the gateway's)."""
    datas = [
        line.removeprefix("data: ")
        for chunk in text.split("\n\n")
        for line in chunk.splitlines()
        if line.startswith("data: ")
    ]
    assert datas, text[:500]
    if api == "chat":
        assert datas[-1] == "[DONE]", datas[-3:]
        datas = datas[:-1]
    *events, last = [json.loads(data) for data in datas]
    if api == "chat" and "error" in last or api == "messages" and last["type"] == "error":
        check_error(api, 400, "application/json", json.dumps(last))
        assert last["error"]["type"] not in SERVER_ERRORS, last
    else:
        events.append(last)
        assert api == "chat" or last["type"] in LAST_EVENTS[api], last
        if last.get("type") == "response.failed":
            assert last["response"]["error"]["code"] not in SERVER_ERRORS, last
    for data in events:
        EVENTS[api].validate_python(data)


def check_answer(api: str, status: int, kind: str, text: str, *, stream: bool) -> None:
    assert status < 500, (status, text[:1000])
    if status != 200:
        check_error(api, status, kind, text)
    elif kind.startswith("text/event-stream"):
        assert stream
        check_stream(api, text)
    else:
        assert kind.startswith("application/json"), (kind, text[:500])
        REPLY_MODELS[api].model_validate_json(text)


def still_serves(live: Live) -> None:
    """A healthy session gets its turn."""
    session = live.session()
    status, kind, text = live.post("chat", json.dumps(WARM_UP["chat"]).encode(), session=session, key=session.key)
    assert status == 200, text
    assert openai.types.chat.ChatCompletion.model_validate_json(text).choices[0].message.content == "Sunny."


@pytest.mark.parametrize("api", list(PATHS))
def test_hostile_bodies_get_the_apis_reply_or_its_4xx_and_the_gateway_goes_on(vision, api):
    deployed = sys.getrecursionlimit()
    with live_gateway(vision) as live:

        @settings(
            max_examples=EXAMPLES, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
        )  # fmt: skip
        @given(body=bodies(api), who=st.sampled_from(["session"] * 6 + ["gateway", "cold", "wrong", "none"]))
        def check(body: bytes, who: str) -> None:
            session = live.session()  # each example its own: it runs again as it ran
            with recursion_limit(deployed):
                if who in ("session", "gateway"):
                    warm_up = json.dumps(WARM_UP[api]).encode()
                    assert live.post(api, warm_up, session=session, key=session.key)[0] == 200
                key = {"gateway": live.gateway.key, "wrong": "sk-wrong", "none": None}.get(who, session.key)
                status, kind, text = live.post(api, body, session=session, key=key)
            check_answer(api, status, kind, text, stream=b'"stream": true' in body)
            if who in ("wrong", "none"):
                assert status == 401

        check()
        still_serves(live)
        assert live.gateway.counts["internal_errors"] == 0
