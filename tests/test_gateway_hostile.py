"""Nothing a client sends takes the gateway down, reads what is not its own, or corrupts a trained chain: each
test reproduces one way a request did, and checks that it is now the request's (or its chain's) alone while
other sessions go on being served."""

from __future__ import annotations

import base64
import io
import json
import threading

import anthropic
import anyio
import httpx2
import openai
import pytest
from PIL import Image, ImageFile

from engine.agents import history
from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine
from engine.models import load_tokenizer
from engine.trajectory import Status
from tests.agents.program import TOOLS
from tests.fakes import DeterministicBackend, ScriptedBackend
from tests.family_fixtures import family_tokenizer
from tests.gateway_kit import (  # noqa: F401 -- closes_clients: a fixture
    CALL,
    PROMPT,
    answered,
    anthropic_client,
    assert_sampled_exactly,
    client,
    closes_clients,
    gateway_over,
    key_of,
    sampled,
)
from tests.test_engine import config, env_factory, rows


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": "", "parameters": parameters}}


async def still_serves(gateway, encoder) -> None:
    """Another session gets its turn: the gateway is up and the scheduler takes requests."""
    session = gateway.open_session()
    gateway.scheduler.backend.replies.append(sampled(encoder, "Sunny."))
    with anyio.fail_after(30):
        reply = await client(gateway, session).chat.completions.create(model="policy", messages=PROMPT)
    assert reply.choices[0].message.content == "Sunny."


# -- 1. a tool schema or a template that raises -------------------------------------------------------------


@pytest.mark.anyio
async def test_a_deeply_nested_tool_schema_is_refused_and_the_gateway_goes_on(encoder):
    gateway, backend = gateway_over(encoder, [])
    deep = [tool("deep", nested_schema(400))]  # about 12 KB of JSON
    async with gateway.serving():
        session = gateway.open_session()
        with pytest.raises(openai.BadRequestError, match=r"tools.*nested deeper than"):
            await client(gateway, session).chat.completions.create(model="policy", messages=PROMPT, tools=deep)
        await still_serves(gateway, encoder)
    assert backend.requests and all("deep" not in str(r.input_ids) for r in backend.requests)


RAISES_ON_BOOM = (
    "{%- if tools and tools[0].function.name == 'boom' %}{{- raise_exception('boom is not a tool') }}{%- endif %}"
)


@pytest.mark.anyio
async def test_a_template_that_raises_on_a_requests_tools_fails_that_chain_alone(tokenizer):
    strict = ChatEncoder(load_tokenizer("qwen2.5", chat_template=RAISES_ON_BOOM + tokenizer.chat_template))
    gateway, _ = gateway_over(strict, [])
    async with gateway.serving():
        session = gateway.open_session()
        with pytest.raises(openai.APIStatusError, match="boom is not a tool") as raised:
            await client(gateway, session).chat.completions.create(
                model="policy", messages=PROMPT, tools=[tool("boom", {"type": "object"})]
            )
        assert raised.value.status_code in (400, 502)
        await still_serves(gateway, strict)
        (failed,) = await gateway.finish(session.id)
    assert failed.status == Status.FAILED


@pytest.mark.anyio
async def test_a_prompt_row_whose_tools_break_the_template_fails_its_group_alone(tokenizer):
    strict = ChatEncoder(load_tokenizer("qwen2.5", chat_template=RAISES_ON_BOOM + tokenizer.chat_template))
    prompts = rows(3)
    prompts[1]["metadata"]["tools"] = [tool("boom", {"type": "object"})]
    engine = RolloutEngine(
        backend=DeterministicBackend(), encoder=strict, env_factory=env_factory(), source=prompts,
        config=config(max_failed_share=1.0),
    )  # fmt: skip
    async with engine:
        groups = await engine.rollout(3)
    statuses = {g.row["label"]: {t.status for t in g.trajectories} for g in groups}
    assert statuses == {"0": {Status.COMPLETED}, "1": {Status.FAILED}, "2": {Status.COMPLETED}}
    failed = groups[[g.row["label"] for g in groups].index("1")].trajectories[0]
    assert "boom is not a tool" in failed.errors[-1].message


# -- 2. two requests racing for one chain ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_two_requests_continuing_one_chain_at_once_never_both_continue_it(encoder):
    """Both arrive before either has awaited anything: one continues the chain, the other forks (`concurrent`),
    and a client's retry of the first in that window gets the first's reply."""
    turns = [sampled(encoder, CALL), sampled(encoder, "It is sunny."), sampled(encoder, "It rains.")]
    gateway, backend = gateway_over(encoder, list(turns))
    async with gateway.serving():
        session = gateway.open_session()
        first = await client(gateway, session).chat.completions.create(model="p", messages=PROMPT, tools=TOOLS)
        sunny = answered(PROMPT, first.choices[0], "Sunny.")
        rainy = answered(PROMPT, first.choices[0], "Rain.")
        headers = {"Authorization": f"Bearer {key_of(session)}"}
        replies: dict[str, dict] = {}
        transport = httpx2.ASGITransport(app=gateway.app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://gateway", headers=headers) as http:

            async def ask(name: str, messages: list[dict], retry: int = 0) -> None:
                body = {"model": "p", "messages": messages, "tools": TOOLS}
                extra = {"x-stainless-retry-count": str(retry)}
                reply = await http.post(f"/sessions/{session.id}/v1/chat/completions", json=body, headers=extra)
                replies[name] = reply.json()

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(ask, "sunny", sunny)
                    tasks.start_soon(ask, "rainy", rainy)
                    tasks.start_soon(ask, "sunny again", sunny, 1)
        chains = await gateway.finish(session.id)
    assert len(backend.requests) == 3  # the first turn, then one turn for each of the two conversations
    assert replies["sunny again"]["choices"][0]["message"] == replies["sunny"]["choices"][0]["message"]
    main, fork = chains
    assert fork.metadata["fork_cause"] == "concurrent" and session.forks == {"concurrent": 1}
    observations = gateway.scheduler.encoder.tokenizer.decode(list(main.response_ids))
    assert ("Sunny." in observations) != ("Rain." in observations)  # one tool result on the trained chain
    answer = replies["sunny" if "Sunny." in observations else "rainy"]["choices"][0]["message"]["content"]
    assert_sampled_exactly(main, [turns[0], sampled(gateway.scheduler.encoder, answer)])


# -- 3, 4, 12. images, bodies --------------------------------------------------------------------------------


def png(width: int, height: int, mode: str = "RGB") -> str:
    buffer = io.BytesIO()
    Image.new(mode, (width, height)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def picture_message(*urls: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}


@pytest.mark.anyio
async def test_an_image_url_naming_a_file_or_a_host_is_refused_unread(processor, tmp_path):
    vision = ChatEncoder(processor.tokenizer, processor=processor)
    secret = tmp_path / "secret.png"
    Image.new("RGB", (28, 28), (1, 2, 3)).save(secret)
    gateway, backend = gateway_over(vision, [])
    async with gateway.serving():
        session = gateway.open_session()
        errors = []
        for url in (str(secret), str(tmp_path / "missing.png"), f"file://{secret}", "http://169.254.169.254/x.png"):
            with pytest.raises(openai.BadRequestError) as raised:
                await client(gateway, session).chat.completions.create(model="p", messages=[picture_message(url)])
            errors.append(raised.value.message.replace(url, "URL"))
        await still_serves(gateway, vision)
    assert all("data: URL" in error for error in errors)
    assert len(set(errors)) == 1  # the same words whether or not a file is there: nothing is told of the host
    assert all(not r.image_data for r in backend.requests)


@pytest.mark.anyio
async def test_a_body_past_the_bound_is_refused_unread(encoder):
    gateway, backend = gateway_over(encoder, [])
    huge = json.dumps({"model": "p", "messages": [{"role": "user", "content": "x" * (32 << 20)}]}).encode()
    async with gateway.serving():
        session = gateway.open_session()
        headers = {"Authorization": f"Bearer {key_of(session)}", "Content-Type": "application/json"}
        async with httpx2.AsyncClient(base_url=gateway.base_url(session), timeout=60) as http:
            sized = await http.post("/chat/completions", content=huge, headers=headers)

            async def chunks():  # no Content-Length: the bound holds as the body streams in
                for start in range(0, len(huge), 1 << 20):
                    yield huge[start : start + (1 << 20)]

            streamed = await http.post("/chat/completions", content=chunks(), headers=headers)
        await still_serves(gateway, encoder)
    for reply in (sized, streamed):
        assert reply.status_code == 413
        assert "bytes" in reply.json()["error"]["message"]
    assert len(backend.requests) == 1  # still_serves' alone


@pytest.mark.anyio
async def test_images_past_their_count_or_pixels_are_refused_undecoded(processor):
    vision = ChatEncoder(processor.tokenizer, processor=processor)
    gateway, backend = gateway_over(vision, [])
    bomb = png(12_000, 12_000, mode="1")  # a few KB of PNG, 144 million pixels
    async with gateway.serving():
        session = gateway.open_session()
        with pytest.raises(openai.BadRequestError, match="pixels"):
            await client(gateway, session).chat.completions.create(model="p", messages=[picture_message(bomb)])
        many = [png(8, 8)] * (gateway.limits.max_images + 1)
        with pytest.raises(openai.BadRequestError, match="images"):
            await client(gateway, session).chat.completions.create(model="p", messages=[picture_message(*many)])
        await still_serves(gateway, vision)
    assert len(backend.requests) == 1


@pytest.mark.anyio
async def test_an_image_part_is_keyed_by_its_digest_not_its_bytes():
    """Matching a request against a chain keys each image by a digest: a screenshot-heavy agent's requests are
    not serialized part by part on the event loop."""
    big = "data:image/png;base64," + "A" * (4 << 20)
    message = {"role": "user", "content": [{"type": "image", "image": big}, {"type": "text", "text": "Look."}]}
    key = history.key(message)
    assert len(repr(key)) < 1000
    other = {"role": "user", "content": [{"type": "image", "image": big[:-1] + "B"}, {"type": "text", "text": "Look."}]}
    assert history.key(other) != key


@pytest.mark.anyio
async def test_a_large_body_is_read_off_the_event_loop(encoder, monkeypatch):
    from engine.agents import wire

    threads = []
    read = wire.parse_json

    def parse(body: bytes):
        threads.append(threading.current_thread())
        return read(body)

    monkeypatch.setattr(wire, "parse_json", parse)
    gateway, _ = gateway_over(encoder, [sampled(encoder, "Long.")])
    async with gateway.serving():
        session = gateway.open_session()
        long = [PROMPT[0], {"role": "user", "content": "word " * 200_000}]
        await client(gateway, session).chat.completions.create(model="p", messages=long)
    assert threads and all(thread is not threading.main_thread() for thread in threads)


# -- 6. cached encoders --------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_encoders_for_distinct_tool_sets_are_bounded(tokenizer):
    encoder = ChatEncoder(tokenizer)  # its own: the cache is what is measured
    gateway, _ = gateway_over(encoder, [sampled(encoder, "Sunny.")] * 80)
    async with gateway.serving():
        for i in range(80):
            session = gateway.open_session()
            tools = [tool(f"tool_{i}", {"type": "object"})]
            await client(gateway, session).chat.completions.create(model="p", messages=PROMPT, tools=tools)
            await gateway.finish(session.id)
    assert 0 < encoder.cached_tool_sets <= encoder.max_tool_sets < 80


# -- 7. a client that re-serializes arguments ----------------------------------------------------------------

NUMBERS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3.0, "id": 12345678901234567891}}\n</tool_call>'  # noqa: E501


@pytest.mark.anyio
async def test_a_node_client_echoing_numbers_its_own_way_continues_the_chain(encoder):
    """JavaScript reads 3.0 as 3 and rounds integers past 2**53: the echo is the same call, not an edit."""
    turns = [sampled(encoder, NUMBERS), sampled(encoder, "Sunny for three days.")]
    gateway, _ = gateway_over(encoder, list(turns))
    async with gateway.serving():
        session = gateway.open_session()
        first = await client(gateway, session).chat.completions.create(model="p", messages=PROMPT, tools=TOOLS)
        echoed = answered(PROMPT, first.choices[0])
        call = echoed[-2]["tool_calls"][0]["function"]
        assert json.loads(call["arguments"]) == {"city": "Paris", "days": 3.0, "id": 12345678901234567891}
        call["arguments"] = '{"city":"Paris","days":3,"id":12345678901234567000}'  # JSON.stringify(JSON.parse(x))
        await client(gateway, session).chat.completions.create(model="p", messages=echoed, tools=TOOLS)
        chains = await gateway.finish(session.id)
    assert len(chains) == 1 and session.forks == {}
    assert_sampled_exactly(chains[0], turns)


# -- 8, 9. roles and stop sequences --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_developer_message_reaches_the_prompt(encoder):
    gateway, _ = gateway_over(encoder, [sampled(encoder, "Il fait beau.")])
    asked = [{"role": "developer", "content": "Answer in French."}, PROMPT[1]]
    async with gateway.serving():
        session = gateway.open_session()
        await client(gateway, session).chat.completions.create(model="p", messages=asked)
        (trajectory,) = await gateway.finish(session.id)
    prompt = encoder.tokenizer.decode(list(trajectory.tokens)[: trajectory.prompt_length])
    assert "Answer in French." in prompt


class StopStringBackend(ScriptedBackend):
    """Stops a scripted reply at the first of the request's stop strings, as SGLang does (the string kept)."""

    def __init__(self, replies, tokenizer):
        super().__init__(replies)
        self.tokenizer = tokenizer

    async def generate(self, input_ids, sampling_params, image_data=None, **kwargs):
        result = await super().generate(input_ids, sampling_params, image_data, **kwargs)
        for n in range(1, len(result.token_ids) + 1):
            text = self.tokenizer.decode(result.token_ids[:n])
            if any(stop in text for stop in sampling_params.stop):
                ids = result.token_ids[:n]
                return type(result)(ids, result.logprobs[:n], text, "stop", result.weight_version, len(input_ids))
        return result


@pytest.mark.anyio
async def test_stop_sequences_end_the_turn_as_each_api_says(encoder):
    replies = [sampled(encoder, "Sunny. STOP and more"), sampled(encoder, "Rainy. END and more")]
    gateway, _ = gateway_over(encoder, [])
    backend = gateway.scheduler.backend = StopStringBackend(replies, encoder.tokenizer)
    async with gateway.serving():
        chat = await client(gateway, gateway.open_session()).chat.completions.create(
            model="p", messages=PROMPT, stop=["STOP"]
        )
        message = await anthropic_client(gateway, gateway.open_session()).messages.create(
            model="p", max_tokens=64, messages=PROMPT[1:], stop_sequences=["END"]
        )
    assert [r.sampling_params.stop for r in backend.requests] == [("STOP",), ("END",)]
    assert (chat.choices[0].finish_reason, chat.choices[0].message.content) == ("stop", "Sunny. ")
    assert (message.stop_reason, message.stop_sequence, message.content[0].text) == ("stop_sequence", "END", "Rainy. ")


# -- 10. asking again ----------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_asking_again_samples_again_and_only_a_retry_gets_the_reply_it_repeats(encoder):
    turns = [sampled(encoder, "Sunny."), sampled(encoder, "Cloudy."), sampled(encoder, "Never sampled.")]
    gateway, backend = gateway_over(encoder, list(turns))
    async with gateway.serving():
        session = gateway.open_session()
        agent = client(gateway, session)
        first = await agent.chat.completions.create(model="p", messages=PROMPT)
        second = await agent.chat.completions.create(model="p", messages=PROMPT)  # best-of-n: ask again
        retried = await agent.chat.completions.create(
            model="p", messages=PROMPT, extra_headers={"x-stainless-retry-count": "1"}
        )
        chains = await gateway.finish(session.id)
    assert [first.choices[0].message.content, second.choices[0].message.content] == ["Sunny.", "Cloudy."]
    assert retried.choices[0].message.content == "Cloudy."
    assert len(backend.requests) == 2 and len(chains) == 2 and session.forks == {"again": 1}


# -- 13. malformed bodies ------------------------------------------------------------------------------------

MALFORMED_CHAT = [
    b"[1, 2]",
    b'{"model": "p", "messages": [1]}',
    b'{"model": "p", "messages": [{"role": "user", "content": {"a": 1}}]}',
    b'{"model": "p", "messages": [{"role": "user", "content": [1]}]}',
    b'{"model": "p", "messages": [{"role": "assistant", "content": null, "tool_calls": "x"}]}',
    b'{"model": "p", "messages": [{"role": "user", "content": "x"}], "tools": [1]}',
    b'{"model": "p", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
    b'{"model": "p", "messages": [{"role": "user", "content": "x"}], "stop": 5}',
    b'{"model": "p", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}]}',
]
MALFORMED_MESSAGES = [
    b'{"model": "p", "max_tokens": 10, "messages": [1]}',
    b'{"model": "p", "max_tokens": 10, "messages": [{"role": "user", "content": [1]}]}',
    b'{"model": "p", "max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}',
    b'{"model": "p", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}], "tools": [{}]}',
    b'{"model": "p", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}], "system": 5}',
    b'{"model": "p", "max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "image"}]}]}',
]
MALFORMED_RESPONSES = [
    b'{"model": "p", "input": [1]}',
    b'{"model": "p", "input": [{"type": "function_call_output", "output": 5}]}',
    b'{"model": "p", "input": "x", "tools": [1]}',
    b'{"model": "p", "input": [{"type": "message", "role": "user", "content": [5]}]}',
]


@pytest.mark.anyio
async def test_malformed_bodies_get_a_400_in_the_apis_own_format(encoder):
    gateway, _ = gateway_over(encoder, [])
    async with gateway.serving():
        session = gateway.open_session()
        headers = {"Authorization": f"Bearer {key_of(session)}", "Content-Type": "application/json"}
        answers = []
        async with httpx2.AsyncClient(base_url=gateway.base_url(session), headers=headers, timeout=30) as http:
            for path, bodies in (
                ("/chat/completions", MALFORMED_CHAT),
                ("/messages", MALFORMED_MESSAGES),
                ("/responses", MALFORMED_RESPONSES),
            ):
                for body in bodies:
                    reply = await http.post(path, content=body)
                    answers.append((path, body, reply.status_code, reply.headers["content-type"], reply.text))
        await still_serves(gateway, encoder)
    for path, body, status, kind, text in answers:
        assert status == 400 and kind.startswith("application/json"), (path, body, status, text)
        error = json.loads(text)
        if path == "/messages":
            assert error["type"] == "error" and error["error"]["message"], (body, error)
        else:
            assert error["error"]["message"] and error["error"]["type"] == "invalid_request_error", (body, error)


# -- 14. keys ------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_request_without_its_sessions_key_is_refused(encoder):
    gateway, backend = gateway_over(encoder, [sampled(encoder, "Sunny.")])
    async with gateway.serving():
        session, other = gateway.open_session(), gateway.open_session()
        wrong = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=key_of(other), max_retries=0)
        wrong_anthropic = anthropic.AsyncAnthropic(
            base_url=gateway.base_url(session, "anthropic"), api_key="sk-guess", max_retries=0
        )
        try:
            with pytest.raises(openai.AuthenticationError, match="key"):
                await wrong.chat.completions.create(model="p", messages=PROMPT)
            with pytest.raises(anthropic.AuthenticationError, match="key"):
                await wrong_anthropic.messages.create(model="p", max_tokens=8, messages=PROMPT[1:])
        finally:
            await wrong.close()
            await wrong_anthropic.close()
        reply = await client(gateway, session).chat.completions.create(model="p", messages=PROMPT)
        assert reply.choices[0].message.content == "Sunny."
    assert len(backend.requests) == 1 and gateway.counts["bad_requests:401"] == 2


# -- 15-19. found by the property test (tests/test_gateway_properties.py) ------------------------------------


async def post_raw(gateway, session, path: str, body: dict | bytes, **headers) -> httpx2.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key_of(session)}", "Content-Type": "application/json", **headers}
    async with httpx2.AsyncClient(base_url=gateway.base_url(session), timeout=60) as http:
        return await http.post(path, content=content, headers=headers)


@pytest.mark.anyio
async def test_call_ids_and_a_functions_name_that_are_no_strings_are_refused(encoder):
    """A tool message answering a call id that was an object failed the request with a 500 (unhashable)."""
    gateway, _ = gateway_over(encoder, [])
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    conversations = [
        [
            *PROMPT,
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": {"a": 1}, "content": "x"},
        ],
        [*PROMPT, {"role": "assistant", "tool_calls": [{**call, "id": ["call_1"]}]}],
        [*PROMPT, {"role": "function", "name": {"type": "object"}, "content": "Sunny."}],
    ]
    async with gateway.serving():
        session = gateway.open_session()
        replies = [
            await post_raw(gateway, session, "/chat/completions", {"model": "p", "messages": m}) for m in conversations
        ]
        await still_serves(gateway, encoder)
    assert [reply.status_code for reply in replies] == [400, 400, 400], [reply.text for reply in replies]
    assert all("string" in reply.json()["error"]["message"] for reply in replies)
    assert gateway.counts["internal_errors"] == 0


def nest(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


@pytest.mark.anyio
async def test_a_message_nested_past_the_bound_is_refused_not_its_chain_failed(encoder):
    """Arguments nested 700 levels deep read as JSON, then failed the chain's template (RecursionError): a 502."""
    gateway, _ = gateway_over(encoder, [])
    deep = nest(700)
    call = f'{{"id": "c1", "type": "function", "function": {{"name": "get_weather", "arguments": {deep}}}}}'
    chat = (
        f'{{"model": "p", "messages": [{json.dumps(PROMPT[1])}, {{"role": "assistant", "tool_calls": [{call}]}}, '
        '{"role": "tool", "tool_call_id": "c1", "content": "Sunny."}]}'
    )
    messages = (
        f'{{"model": "p", "max_tokens": 8, "messages": [{json.dumps(PROMPT[1])}, {{"role": "assistant", "content": '
        f'[{{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {{"a": {deep}}}}}]}}, {{"role": "user", '
        '"content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny."}]}]}'
    )
    responses = (
        f'{{"model": "p", "input": [{{"type": "function_call", "call_id": "c1", "name": "f", "arguments": {deep}}}, '
        '{"type": "function_call_output", "call_id": "c1", "output": "Sunny."}]}'
    )
    async with gateway.serving():
        session = gateway.open_session()
        replies = [
            await post_raw(gateway, session, path, body.encode())
            for path, body in (("/chat/completions", chat), ("/messages", messages), ("/responses", responses))
        ]
        await still_serves(gateway, encoder)
    assert [reply.status_code for reply in replies] == [400, 400, 400], [reply.text[:300] for reply in replies]
    assert all("nested deeper than 64 levels" in reply.text for reply in replies)
    assert len(gateway.scheduler.backend.requests) == 1 and session.chains == []  # still_serves' alone


def cut_image(kind: str) -> str:
    """An image whose header reads (its size is known) and whose pixels are cut short."""
    buffer = io.BytesIO()
    Image.frombytes("RGB", (32, 32), bytes(range(256)) * 12).save(buffer, format=kind)
    data = buffer.getvalue()
    return f"data:image/{kind.lower()};base64," + base64.b64encode(data[: len(data) * 2 // 3]).decode("ascii")


@pytest.mark.anyio
async def test_an_image_cut_short_or_too_thin_is_refused_not_its_chain_failed(processor):
    """A truncated image's header read, so it passed the gateway and failed its chain when decoded (a 502); an
    image 1x300 failed in the processor (aspect ratio past 200)."""
    vision = ChatEncoder(processor.tokenizer, processor=processor)
    gateway, backend = gateway_over(vision, [])
    async with gateway.serving():
        session = gateway.open_session()
        errors = []
        for url in (cut_image("PNG"), cut_image("JPEG"), cut_image("BMP"), png(1, 300)):
            with pytest.raises(openai.BadRequestError) as raised:
                await client(gateway, session).chat.completions.create(model="p", messages=[picture_message(url)])
            errors.append(raised.value.message)
        await still_serves(gateway, vision)
    assert [("does not decode" in e, "times the other" in e) for e in errors] == [(True, False)] * 3 + [(False, True)]
    assert len(backend.requests) == 1 and session.chains == []


@pytest.mark.anyio
async def test_an_image_that_decoded_is_not_decoded_again():
    """A conversation sends its images again with every request: each is decoded (to check it) once."""
    from engine.agents.limits import GatewayLimits, check_images
    from engine.multimodal import BoundedCache

    decoded = BoundedCache(100, size=lambda _: 1)
    messages = [{"role": "user", "content": [{"type": "image", "image": png(8, 8)}]}]  # as the dialects read it
    loads = []
    load = ImageFile.ImageFile.load
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ImageFile.ImageFile, "load", lambda image: loads.append(image) or load(image))
        check_images(messages, GatewayLimits(), decoded)
        first = len(loads)
        check_images(messages, GatewayLimits(), decoded)
    assert first > 0 and len(loads) == first


@pytest.mark.anyio
async def test_a_new_message_without_content_is_refused_and_its_chain_goes_on(encoder):
    """A user message with no content, continuing a chain, failed that chain (its observation did not format):
    the agent's trained chain ended FAILED on a malformed request."""
    turns = [sampled(encoder, "Sunny."), sampled(encoder, "Warm, too.")]
    gateway, _ = gateway_over(encoder, list(turns))
    async with gateway.serving():
        session = gateway.open_session()
        agent = client(gateway, session)
        first = await agent.chat.completions.create(model="p", messages=PROMPT)
        asked = [*PROMPT, first.choices[0].message.model_dump(exclude_none=True)]
        bad = await post_raw(
            gateway, session, "/chat/completions", {"model": "p", "messages": [*asked, {"role": "user"}]}
        )
        again = await agent.chat.completions.create(model="p", messages=[*asked, {"role": "user", "content": "And?"}])
        (chain,) = await gateway.finish(session.id)
    assert bad.status_code == 400 and "without content" in bad.json()["error"]["message"]
    assert again.choices[0].message.content == "Warm, too."
    assert chain.status == Status.COMPLETED and session.forks == {}
    assert_sampled_exactly(chain, turns)


@pytest.mark.anyio
async def test_a_refusal_before_the_body_is_read_reaches_a_client_that_closes(encoder):
    """Refused before its body was read (a wrong key), a request that said `Connection: close` had its connection
    closed with the body unread in it: reset, the client lost the 401 (a connection error instead)."""
    gateway, _ = gateway_over(encoder, [])
    body = json.dumps({"model": "p", "messages": [{"role": "user", "content": "x" * (8 << 20)}]}).encode()
    async with gateway.serving():
        session = gateway.open_session()
        replies = [
            await post_raw(
                gateway, session, "/chat/completions", body, Authorization="Bearer sk-wrong", Connection="close"
            )
            for _ in range(5)
        ]
        await still_serves(gateway, encoder)
    assert [reply.status_code for reply in replies] == [401] * 5
    assert all(reply.json()["error"]["code"] == "invalid_api_key" for reply in replies)


@pytest.mark.anyio
async def test_tools_offered_to_a_model_whose_calls_cannot_be_read_are_refused_naming_why():
    """No family and no call syntax in the template (gemma-3 writes no calls): a request offering tools is the
    client's 400 naming what is missing, never read as another family's syntax; one without tools is served."""
    gemma = ChatEncoder(family_tokenizer("google-gemma-3-4b-it"))
    assert gemma.parser is None
    gateway, _ = gateway_over(gemma, [sampled(gemma, "Sunny.")])
    async with gateway.serving():
        session = gateway.open_session()
        with pytest.raises(openai.BadRequestError, match="the template writes no structured tool calls") as raised:
            await client(gateway, session).chat.completions.create(
                model="policy", messages=PROMPT, tools=[tool("get_weather", {"type": "object"})]
            )
        assert "--model-family" in str(raised.value)
        reply = await client(gateway, session).chat.completions.create(model="policy", messages=PROMPT)
        assert reply.choices[0].message.content == "Sunny."
        await gateway.finish(session.id)
