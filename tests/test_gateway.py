"""The session gateway with the official `openai` SDK, unmodified, over a policy that answers with real tool
calls through the real Qwen tokenizer and template (a scripted backend: the sampled tokens are known): the
replies the client parses, the trajectories the sessions leave (the sampled tokens, mask 1 exactly on them),
forks, and bad requests as the API's own errors."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import socket

import anthropic
import anyio
import httpx2
import openai
import pytest
from PIL import Image

from engine.encoding import ChatEncoder
from engine.errors import BackendError, ErrorClass
from engine.families import family_named
from engine.scheduler.retry import RetryPolicy
from engine.trajectory import Status, StopReason
from tests.agents.program import TOOLS
from tests.fakes import ScriptedBackend
from tests.gateway_kit import (  # noqa: F401 -- closes_clients: a fixture
    CALL,
    OPEN_CLIENTS,
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


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


@pytest.mark.anyio
async def test_a_tool_calling_session_through_the_openai_sdk(encoder):
    turns = [sampled(encoder, CALL), sampled(encoder, "It is sunny in Paris.")]
    gateway, backend = gateway_over(encoder, list(turns))
    async with gateway.serving():
        session = gateway.open_session()
        agent = client(gateway, session)
        first = await agent.chat.completions.create(model="policy", messages=PROMPT, tools=TOOLS, temperature=0.2)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        messages = answered(PROMPT, choice)  # the agent runs its tool and sends the conversation back
        second = await agent.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        assert second.choices[0].message.content == "It is sunny in Paris."
        assert second.choices[0].finish_reason == "stop"
        assert second.usage.completion_tokens == len(turns[1])
        (trajectory,) = await gateway.finish(session.id)
    assert gateway.counts["sampling_ignored:temperature"] == 1  # the rollout's temperature ruled
    assert backend.requests[0].sampling_params.temperature == 1.0
    assert trajectory.status == Status.COMPLETED and len(trajectory.turns) == 2
    assert_sampled_exactly(trajectory, turns)
    # what stands between the turns is what the template appends for the tool message
    conversation = [*PROMPT, encoder.assistant_message(turns[0]), messages[-1]]
    whole = encoder.for_tools(TOOLS).render(conversation, add_generation_prompt=True)
    assert (
        encoder.tokenizer.decode(list(trajectory.tokens)[: trajectory.prompt_length + trajectory.turns[1].start])
        == whole
    )
    assert (
        backend.requests[1].input_ids == list(trajectory.tokens)[: trajectory.prompt_length + trajectory.turns[1].start]
    )


@pytest.mark.anyio
async def test_streaming_replies_carry_the_calls_and_the_usage(encoder):
    turns = [sampled(encoder, "<think>\nI should look it up.\n</think>\n\n" + CALL)]
    gateway, _ = gateway_over(encoder, list(turns))
    async with gateway.serving():
        session = gateway.open_session()
        stream = await client(gateway, session).chat.completions.create(
            model="policy", messages=PROMPT, tools=TOOLS, stream=True, stream_options={"include_usage": True}
        )
        events = [event async for event in stream]
        await gateway.finish(session.id)
    deltas = [e.choices[0].delta for e in events if e.choices]
    calls = [call for delta in deltas for call in delta.tool_calls or ()]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    reasoning = [getattr(d, "reasoning_content", None) for d in deltas if getattr(d, "reasoning_content", None)]
    assert len(reasoning) > 1 and "".join(reasoning) == "I should look it up."  # streamed as it was generated
    assert [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason] == ["tool_calls"]
    assert events[-1].usage.completion_tokens == len(turns[0])


@pytest.mark.anyio
async def test_a_request_that_edits_the_history_forks_a_new_chain(encoder):
    turns = [sampled(encoder, CALL), sampled(encoder, "Paris is sunny."), sampled(encoder, CALL)]
    gateway, _ = gateway_over(encoder, list(turns))
    async with gateway.serving():
        session = gateway.open_session()
        agent = client(gateway, session)
        first = await agent.chat.completions.create(model="policy", messages=PROMPT, tools=TOOLS)
        reply = first.choices[0].message.model_dump(exclude_none=True)
        tool = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "Sunny."}
        await agent.chat.completions.create(model="policy", messages=[*PROMPT, reply, tool], tools=TOOLS)
        compacted = [{"role": "system", "content": "Summary: the user asked about Paris."}, PROMPT[1]]
        await agent.chat.completions.create(model="policy", messages=compacted, tools=TOOLS)
        chains = await gateway.finish(session.id)
    assert [len(c.turns) for c in chains] == [2, 1]
    assert chains[1].prompt == compacted and chains[1].metadata["fork_cause"] == "edited"
    assert gateway.counts["forks:edited"] == 1 and session.forks == {"edited": 1}
    assert_sampled_exactly(chains[0], turns[:2])
    assert_sampled_exactly(chains[1], turns[2:])


@pytest.mark.anyio
async def test_bad_requests_are_the_apis_own_errors_and_end_nothing_else(encoder):
    gateway, _ = gateway_over(encoder, [sampled(encoder, "Sunny.")], client_sampling="refuse")
    async with gateway.serving():
        session = gateway.open_session()
        agent = client(gateway, session)
        stranger = openai.AsyncOpenAI(base_url=f"{gateway.url}/sessions/nobody/v1", api_key=gateway.key, max_retries=0)
        OPEN_CLIENTS.append(stranger)
        with pytest.raises(openai.NotFoundError, match="no open session 'nobody'"):
            await stranger.chat.completions.create(model="policy", messages=PROMPT)
        with pytest.raises(openai.BadRequestError, match="n=2: a session samples one reply per request"):
            await agent.chat.completions.create(model="policy", messages=PROMPT, n=2)
        with pytest.raises(openai.BadRequestError, match="temperature: the rollout's sampling settings rule"):
            await agent.chat.completions.create(model="policy", messages=PROMPT, temperature=0.7)
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\].role is 'robot'; one of system"):
            await agent.chat.completions.create(model="policy", messages=[{"role": "robot", "content": "x"}])
        reply = await agent.chat.completions.create(model="policy", messages=PROMPT)  # the session still serves
        assert reply.choices[0].message.content == "Sunny."
        await gateway.finish(session.id)
    assert gateway.counts["bad_requests:400"] == 3 and gateway.counts["bad_requests:404"] == 1


@pytest.mark.anyio
async def test_a_server_error_is_retried_inside_the_request_unseen_by_the_agent(encoder):
    gateway, backend = gateway_over(
        encoder, [BackendError(ErrorClass.SERVER, "503 from the server"), sampled(encoder, "Sunny.")]
    )
    async with gateway.serving():
        session = gateway.open_session()
        reply = await client(gateway, session).chat.completions.create(model="policy", messages=PROMPT)
        assert reply.choices[0].message.content == "Sunny."
        (trajectory,) = await gateway.finish(session.id)
    assert len(backend.requests) == 2 and trajectory.turns[0].retries == 1 and trajectory.status == Status.COMPLETED


@pytest.mark.anyio
async def test_a_backend_failure_ends_its_session_alone(encoder):
    fatal = BackendError(ErrorClass.MALFORMED, "the server sent garbage")
    no_retries = RetryPolicy(per_turn={}, env_step_timeout_s=60)
    gateway, _ = gateway_over(encoder, [fatal, sampled(encoder, "Sunny.")], retry=no_retries)
    async with gateway.serving():
        broken, healthy = gateway.open_session(), gateway.open_session()
        with pytest.raises(openai.APIStatusError, match="the server sent garbage") as raised:
            await client(gateway, broken).chat.completions.create(model="policy", messages=PROMPT)
        assert raised.value.status_code == 502
        reply = await client(gateway, healthy).chat.completions.create(model="policy", messages=PROMPT)
        assert reply.choices[0].message.content == "Sunny."
        (failed,) = await gateway.finish(broken.id)
        (served,) = await gateway.finish(healthy.id)
    assert failed.status == Status.FAILED and served.status == Status.COMPLETED


@pytest.mark.anyio
async def test_sessions_waiting_for_their_agents_hold_no_env_slot(encoder):
    """One env slot, three sessions whose agents have not come back: each still gets its turn."""
    gateway, _ = gateway_over(encoder, [sampled(encoder, "Sunny.")] * 3, max_env_steps=1)
    async with gateway.serving():
        sessions = [gateway.open_session() for _ in range(3)]
        with anyio.fail_after(30):  # a slot held by a waiting session would stall the second request here
            for session in sessions:
                reply = await client(gateway, session).chat.completions.create(model="policy", messages=PROMPT)
                assert reply.choices[0].message.content == "Sunny."
        assert gateway.scheduler.env_slots.borrowed == 0
        for session in sessions:
            await gateway.finish(session.id)


@pytest.mark.anyio
async def test_a_request_during_a_weight_update_is_held_and_answered_on_the_new_weights(encoder):
    turns = [sampled(encoder, CALL), sampled(encoder, "It is sunny in Paris.")]
    gateway, backend = gateway_over(encoder, list(turns))
    scheduler = gateway.scheduler
    async with gateway.serving():
        session = gateway.open_session()
        agent = client(gateway, session)
        first = (await agent.chat.completions.create(model="policy", messages=PROMPT, tools=TOOLS)).choices[0]
        messages = answered(PROMPT, first)
        await scheduler.pause_generation()  # the trainer updates the weights
        backend.weight_version_ = "v1"
        replies = []

        async def ask() -> None:
            replies.append(await agent.chat.completions.create(model="policy", messages=messages, tools=TOOLS))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(ask)
            while scheduler.num_parked == 0:  # the request reached the scheduler and waits there, PAUSED
                await scheduler.parked_or_ended()
            assert replies == []
            scheduler.resume_generation("v1")
        (trajectory,) = await gateway.finish(session.id)
    assert replies[0].choices[0].message.content == "It is sunny in Paris."
    assert [turn.weight_version for turn in trajectory.turns] == ["v0", "v1"]
    assert trajectory.status == Status.COMPLETED
    assert_sampled_exactly(trajectory, turns)


@pytest.mark.anyio
async def test_an_openai_agents_sdk_agent_with_a_function_tool_runs_as_one_session(encoder):
    agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents) is a dev dependency")
    agents.set_tracing_disabled(True)  # nothing leaves the machine
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return "Sunny, 24 C."

    turns = [sampled(encoder, CALL), sampled(encoder, "It is sunny in Paris.")]
    gateway, backend = gateway_over(encoder, list(turns))
    async with gateway.serving():
        session = gateway.open_session()
        model = agents.OpenAIChatCompletionsModel(model="policy", openai_client=client(gateway, session))
        agent = agents.Agent(name="weather", instructions=PROMPT[0]["content"], tools=[get_weather], model=model)
        result = await agents.Runner.run(agent, PROMPT[1]["content"])
        chains = await gateway.finish(session.id)
    assert seen == ["Paris"] and result.final_output == "It is sunny in Paris."
    assert len(chains) == 1 and len(chains[0].turns) == 2  # the SDK sent its history back unchanged: no fork
    assert chains[0].status == Status.COMPLETED
    assert_sampled_exactly(chains[0], turns)


@pytest.mark.anyio
async def test_a_langgraph_react_agent_runs_as_one_session(encoder):
    """LangGraph's prebuilt ReAct agent on langchain-openai's ChatOpenAI, unmodified, at the session's base URL."""
    prebuilt = pytest.importorskip("langgraph.prebuilt", reason="LangGraph (langgraph) is a dev dependency")
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is a dev dependency")
    from langchain_core.tools import tool

    seen = []

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return "Sunny, 24 C."

    turns = [sampled(encoder, CALL), sampled(encoder, "It is sunny in Paris.")]
    gateway, _ = gateway_over(encoder, list(turns))
    async with gateway.serving():
        session = gateway.open_session()
        model = langchain_openai.ChatOpenAI(
            model="policy", base_url=gateway.base_url(session), api_key=key_of(session), max_retries=0
        )
        agent = prebuilt.create_react_agent(model, [get_weather], prompt=PROMPT[0]["content"])
        state = await agent.ainvoke({"messages": [("user", PROMPT[1]["content"])]})
        chains = await gateway.finish(session.id)
    assert seen == ["Paris"] and state["messages"][-1].content == "It is sunny in Paris."
    assert len(chains) == 1 and len(chains[0].turns) == 2  # LangGraph sent its history back as sent: no fork
    assert chains[0].status == Status.COMPLETED
    assert_sampled_exactly(chains[0], turns)


# -- Anthropic Messages, through the official `anthropic` SDK -------------------------------------------------
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip


@pytest.mark.anyio
async def test_a_tool_use_session_through_the_anthropic_sdk(encoder):
    turns = [sampled(encoder, CALL), sampled(encoder, "It is sunny in Paris.")]
    gateway, backend = gateway_over(encoder, list(turns))
    system, question = PROMPT[0]["content"], [{"role": "user", "content": PROMPT[1]["content"]}]
    async with gateway.serving():
        session = gateway.open_session()
        agent = anthropic_client(gateway, session)
        first = await agent.messages.create(
            model="policy",
            max_tokens=256,
            system=system,
            messages=question,
            tools=ANTHROPIC_TOOLS,
            extra_body={"temperature": 0.5},  # sent by clients whose SDK still has it
        )
        assert first.stop_reason == "tool_use"
        (use,) = first.content
        assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
        history = [
            *question,
            {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 C."}]},
        ]
        second = await agent.messages.create(
            model="policy", max_tokens=256, system=system, messages=history, tools=ANTHROPIC_TOOLS
        )
        assert (second.stop_reason, second.content[0].text) == ("end_turn", "It is sunny in Paris.")
        assert second.usage.output_tokens == len(turns[1])
        (trajectory,) = await gateway.finish(session.id)
    assert gateway.counts["sampling_ignored:temperature"] == 1
    assert len(trajectory.turns) == 2 and trajectory.status == Status.COMPLETED  # one chain: no fork
    assert_sampled_exactly(trajectory, turns)
    tool = {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 24 C.", "name": "get_weather"}  # named
    assert trajectory.turns[0].observation == [tool]


@pytest.mark.anyio
async def test_anthropic_streaming_assembles_thinking_and_tool_use(encoder):
    turns = [sampled(encoder, "<think>\nI should look it up.\n</think>\n\n" + CALL)]
    gateway, _ = gateway_over(encoder, list(turns))
    async with gateway.serving():
        session = gateway.open_session()
        agent = anthropic_client(gateway, session)
        async with agent.messages.stream(
            model="policy", max_tokens=256, messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=ANTHROPIC_TOOLS,
        ) as stream:  # fmt: skip
            final = await stream.get_final_message()
        await gateway.finish(session.id)
    thinking, use = final.content
    assert (thinking.type, thinking.thinking) == ("thinking", "I should look it up.")
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == len(turns[0])


@pytest.mark.anyio
async def test_anthropic_bad_requests_are_its_own_errors(encoder):
    gateway, _ = gateway_over(encoder, [])
    async with gateway.serving():
        session = gateway.open_session()
        agent = anthropic_client(gateway, session)
        with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
            await agent.messages.create(model="policy", max_tokens=0, messages=[{"role": "user", "content": "x"}])
        with pytest.raises(anthropic.BadRequestError, match="a 'tool_use' block has no place in a user message"):
            await agent.messages.create(
                model="policy", max_tokens=8,
                messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
            )  # fmt: skip
        stranger = anthropic.AsyncAnthropic(
            base_url=f"{gateway.url}/sessions/nobody", api_key=gateway.key, max_retries=0
        )
        OPEN_CLIENTS.append(stranger)
        with pytest.raises(anthropic.NotFoundError, match="no open session 'nobody'"):
            await stranger.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "x"}])
        await gateway.finish(session.id)


@pytest.mark.anyio
async def test_images_to_a_policy_without_a_processor_are_refused_not_dropped(encoder):
    gateway, _ = gateway_over(encoder, [])
    picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    async with gateway.serving():
        session = gateway.open_session()
        with pytest.raises(openai.BadRequestError, match="the request holds images, but the policy takes none"):
            await client(gateway, session).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": [picture, {"type": "text", "text": "What?"}]}]
            )
        await gateway.finish(session.id)


@pytest.mark.anyio
async def test_images_reach_the_model_and_the_trainer(processor):
    """OpenAI `image_url` parts (in the prompt) and Anthropic-style later images (a user message after a tool
    result) go to the backend as image_data and to the trainer's inputs, merged once."""
    from engine.multimodal import image_payload

    # Qwen2.5-VL's template writes no tool calls: its family is named, as `--model-family qwen25` does
    vision = ChatEncoder(processor.tokenizer, processor=processor, family=family_named("qwen25"))
    red, blue = (image_payload(Image.new("RGB", (56, 56), color)) for color in ((200, 30, 30), (30, 30, 200)))
    turns = [sampled(vision, CALL), sampled(vision, "Both are squares.")]
    gateway, backend = gateway_over(vision, list(turns))
    first_ask = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": red}},
                                              {"type": "text", "text": "What is this?"}]}]  # fmt: skip
    async with gateway.serving():
        session = gateway.open_session()
        agent = client(gateway, session)
        first = (await agent.chat.completions.create(model="policy", messages=first_ask, tools=TOOLS)).choices[0]
        later = [
            *answered(first_ask, first, "Sunny."),
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": blue}},
                                         {"type": "text", "text": "And this?"}]},
        ]  # fmt: skip
        await agent.chat.completions.create(model="policy", messages=later, tools=TOOLS)
        (trajectory,) = await gateway.finish(session.id)
    assert [len(request.image_data or []) for request in backend.requests] == [1, 2]
    assert len(trajectory.image_data) == 2
    merged = trajectory.train_inputs.merge()
    assert merged is not None and merged["image_grid_thw"].shape[0] == 2  # both images, once each
    assert_sampled_exactly(trajectory, turns)


@pytest.mark.anyio
async def test_a_session_past_the_staleness_bound_ends_stale_and_is_never_regenerated(encoder):
    """Restarting from the prompt would hand the agent replies it never asked for: a chain whose tokens span
    more weight versions than max_staleness ends STALE (not trained on) even under on_stale="restart", and
    the agent's next request gets one clear error."""
    turns = [sampled(encoder, CALL), sampled(encoder, "It is sunny in Paris.")]
    gateway, backend = gateway_over(encoder, list(turns))
    scheduler = gateway.scheduler
    scheduler.max_staleness, scheduler.on_stale = 0, "restart"
    async with gateway.serving():
        session = gateway.open_session()
        agent = client(gateway, session)
        first = (await agent.chat.completions.create(model="policy", messages=PROMPT, tools=TOOLS)).choices[0]
        await scheduler.pause_generation()
        backend.weight_version_ = "v1"
        scheduler.resume_generation("v1")
        messages = answered(PROMPT, first)
        with pytest.raises(openai.ConflictError, match="chain ended stale: its tokens span more weight versions"):
            await agent.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        (trajectory,) = await gateway.finish(session.id)
    assert trajectory.stop_reason == StopReason.STALE and len(backend.requests) == 1  # never regenerated
    assert_sampled_exactly(trajectory, turns[:1])


# -- OpenAI Responses (what the Codex CLI speaks), through the official `openai` SDK -----------------------
RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"], "strict": False} for t in TOOLS]  # fmt: skip


@pytest.mark.anyio
async def test_a_function_calling_session_through_the_responses_api(encoder):
    turns = [sampled(encoder, "<think>\nLook it up.\n</think>\n\n" + CALL), sampled(encoder, "It is sunny in Paris.")]
    gateway, _ = gateway_over(encoder, list(turns))
    async with gateway.serving():
        session = gateway.open_session()
        agent = client(gateway, session)
        question = [{"role": "user", "content": PROMPT[1]["content"]}]
        first = await agent.responses.create(
            model="policy", instructions=PROMPT[0]["content"], input=question, tools=RESPONSES_TOOLS, store=False
        )
        reasoning, call = first.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == "Look it up."
        assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
        # the Codex way: the whole input again, the output items as they came, then the call's output
        history = [
            *question,
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C."},
        ]
        async with agent.responses.stream(
            model="policy", instructions=PROMPT[0]["content"], input=history, tools=RESPONSES_TOOLS, store=False
        ) as stream:
            texts = [event.delta async for event in stream if event.type == "response.output_text.delta"]
            second = await stream.get_final_response()
        (trajectory,) = await gateway.finish(session.id)
    assert len(texts) > 1 and "".join(texts) == second.output_text == "It is sunny in Paris."
    assert second.status == "completed" and second.usage.output_tokens == len(turns[1])
    assert len(trajectory.turns) == 2 and trajectory.status == Status.COMPLETED  # the echo continued the chain
    assert_sampled_exactly(trajectory, turns)


@pytest.mark.anyio
async def test_the_responses_api_refuses_what_the_gateway_does_not_keep(encoder):
    gateway, _ = gateway_over(encoder, [])
    async with gateway.serving():
        session = gateway.open_session()
        agent = client(gateway, session)
        with pytest.raises(openai.BadRequestError, match="previous_response_id: the gateway keeps no responses"):
            await agent.responses.create(model="policy", input="Hi", previous_response_id="resp_1")
        await gateway.finish(session.id)


@pytest.mark.anyio
async def test_a_hosted_tool_the_policy_cannot_call_is_left_out_and_counted(encoder):
    gateway, backend = gateway_over(encoder, [sampled(encoder, "Hello.")])
    weather = {"type": "function", **TOOLS[0]["function"]}
    async with gateway.serving():
        agent = client(gateway, gateway.open_session())
        reply = await agent.responses.create(model="policy", input="Hi", tools=[{"type": "web_search"}, weather])
    assert reply.output_text == "Hello." and gateway.counts["degraded:tool:web_search"] == 1
    prompt = encoder.tokenizer.decode(backend.requests[0].input_ids)
    assert "get_weather" in prompt and "web_search" not in prompt


@pytest.mark.anyio
async def test_the_gateway_serves_its_counts_to_prometheus(encoder):
    from prometheus_client.parser import text_string_to_metric_families

    turns = [sampled(encoder, "Sunny."), sampled(encoder, "Rainy.")]
    gateway, _ = gateway_over(encoder, list(turns))
    async with gateway.serving():
        session = gateway.open_session()
        agent = client(gateway, session)
        await agent.chat.completions.create(model="policy", messages=PROMPT, temperature=0.1, top_p=0.5)
        edited = [{"role": "system", "content": "Be brief."}, PROMPT[1]]
        await agent.chat.completions.create(model="policy", messages=edited)
        with pytest.raises(openai.BadRequestError):
            await agent.chat.completions.create(model="policy", messages=PROMPT, n=3)
        async with httpx2.AsyncClient() as http:
            scraped = (await http.get(f"{gateway.url}/metrics")).text
        await gateway.finish(session.id)
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(scraped)
        for sample in family.samples
    }
    assert samples[("turnstile_agent_requests_total", (("api", "chat/completions"),))] == 3
    assert samples[("turnstile_agent_forks_total", (("cause", "edited"),))] == 1
    assert samples[("turnstile_agent_bad_requests_total", (("status", "400"),))] == 1
    assert samples[("turnstile_agent_sampling_ignored_total", (("field", "temperature"),))] == 1
    assert samples[("turnstile_agent_sampling_ignored_total", (("field", "top_p"),))] == 1
    assert samples[("turnstile_agent_sessions", ())] == 1
    assert samples[("turnstile_agent_chains", (("waiting_for", "agent"),))] == 2  # both chains, between requests


@pytest.mark.anyio
async def test_the_connections_the_gateway_accepts_send_at_once(encoder):
    """TCP_NODELAY on each connection the gateway accepts: with Nagle's algorithm a reply's body (and each streamed
    event) waited for the client's delayed ACK, about 40 ms a request on a connection kept alive."""
    gateway, _ = gateway_over(encoder, [sampled(encoder, "Sunny.")])
    async with gateway.serving():
        session = gateway.open_session()
        async with httpx2.AsyncClient() as http:
            url, body = f"{gateway.base_url(session)}/chat/completions", {"model": "policy", "messages": PROMPT}
            reply = await http.post(url, json=body, headers={"Authorization": f"Bearer {session.key}"})
            assert reply.status_code == 200
            port = int(gateway.url.rsplit(":", 1)[1])
            accepted = [
                t.get_extra_info("socket")
                for t in gc.get_objects()
                if isinstance(t, asyncio.Transport)
                and not t.is_closing()
                and (t.get_extra_info("sockname") or (0, 0))[1] == port
            ]
            assert accepted  # the connection kept alive, the gateway's end of it
            assert all(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for sock in accepted)
        await gateway.finish(session.id)


@pytest.mark.anyio
async def test_a_sessions_tool_set_has_one_encoder(tokenizer):
    """The scheduler (for the chain's prompt) and the gateway (for each reply) key the encoder of a tool set alike:
    one encoder a tool set, built once, so the cache holds `max_tool_sets` tool sets, not half as many."""
    encoder = ChatEncoder(tokenizer)  # its own: its cache is what is checked
    gateway, _ = gateway_over(encoder, [sampled(encoder, "Sunny."), sampled(encoder, "Rainy.")])
    async with gateway.serving():
        session = gateway.open_session()
        agent = client(gateway, session)
        reply = await agent.chat.completions.create(model="policy", messages=PROMPT, tools=TOOLS)
        more = [*PROMPT, reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And?"}]
        async for _ in await agent.chat.completions.create(model="policy", messages=more, tools=TOOLS, stream=True):
            pass
        await gateway.finish(session.id)
    assert encoder.cached_tool_sets == 1


class GatedBackend(ScriptedBackend):
    """Replies once `gate` is set: a long generation."""

    def __init__(self, replies):
        super().__init__(replies)
        self.gate = anyio.Event()

    async def generate(self, *args, **kwargs):
        await self.gate.wait()
        return await super().generate(*args, **kwargs)


@pytest.mark.anyio
async def test_a_client_that_gives_up_and_retries_gets_the_one_reply_of_one_chain(encoder):
    """An SDK's timeout and retry (the same request again, while the first is generating or after its reply was
    lost) is answered with the turn the first one got: no second generation, no fork."""
    turns = [sampled(encoder, "It is sunny in Paris."), sampled(encoder, "Never sampled.")]
    gateway, _ = gateway_over(encoder, [])
    backend = gateway.scheduler.backend = GatedBackend(list(turns))
    async with gateway.serving():
        session = gateway.open_session()
        impatient = client(gateway, session, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            await impatient.chat.completions.create(model="policy", messages=PROMPT)
        replies = []

        async def retry() -> None:
            replies.append(await client(gateway, session).chat.completions.create(model="policy", messages=PROMPT))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(retry)
            backend.gate.set()
        again = await client(gateway, session).chat.completions.create(
            model="policy", messages=PROMPT, extra_headers={"x-stainless-retry-count": "1"}
        )  # a reply lost on the way: the SDK's retry says so
        chains = await gateway.finish(session.id)
    assert replies[0].choices[0].message.content == again.choices[0].message.content == "It is sunny in Paris."
    assert len(backend.requests) == 1 and len(chains) == 1 and session.forks == {}
    assert gateway.counts["repeats"] == 2
    assert_sampled_exactly(chains[0], turns[:1])


@pytest.mark.anyio
async def test_a_clients_max_tokens_caps_its_turn_and_the_rollouts_cap_still_holds(encoder):
    long = sampled(encoder, "It is sunny in Paris, with a light wind from the west.")
    gateway, backend = gateway_over(encoder, [long, long])
    async with gateway.serving():
        session = gateway.open_session()
        agent = client(gateway, session)
        short = await agent.chat.completions.create(model="policy", messages=PROMPT, max_completion_tokens=4)
        assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 4
        messages = [
            *PROMPT,
            short.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "More."},
        ]
        await agent.chat.completions.create(model="policy", messages=messages, max_tokens=100_000)
        (trajectory,) = await gateway.finish(session.id)
    assert [r.sampling_params.max_new_tokens for r in backend.requests] == [4, 256]  # the rollout's 256 rules above
    assert_sampled_exactly(trajectory, [long[:4], long])


@pytest.mark.anyio
async def test_a_client_that_leaves_mid_stream_ends_nothing_and_its_retry_gets_the_reply(encoder):
    turns = [sampled(encoder, "<think>\nThinking.\n</think>\n\n" + CALL)]
    gateway, backend = gateway_over(encoder, list(turns))
    async with gateway.serving():
        session = gateway.open_session()
        body = {"model": "policy", "messages": PROMPT, "tools": TOOLS, "stream": True}
        async with (
            httpx2.AsyncClient(base_url=gateway.base_url(session), timeout=60) as http,
            http.stream("POST", "/chat/completions", json=body, headers={"x-api-key": key_of(session)}) as stream,
        ):
            async for line in stream.aiter_lines():
                if line.startswith("data: "):
                    break  # the first event read, then the connection closed under the rest
        again = await client(gateway, session).chat.completions.create(
            model="policy", messages=PROMPT, tools=TOOLS, extra_headers={"x-stainless-retry-count": "1"}
        )
        (trajectory,) = await gateway.finish(session.id)
    assert again.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert len(backend.requests) == 1 and gateway.counts["repeats"] == 1  # the one turn, sent again
    assert trajectory.status == Status.COMPLETED and session.forks == {}


class CachingBackend(ScriptedBackend):
    """Reports every prompt token but the last 7 as found in the server's prefix cache."""

    async def generate(self, input_ids, sampling_params, image_data=None, *, rid=None, session_id=None):
        result = await super().generate(input_ids, sampling_params, image_data, rid=rid, session_id=session_id)
        return dataclasses.replace(result, cached_tokens=len(input_ids) - 7)


@pytest.mark.anyio
async def test_each_api_reports_the_prompt_tokens_the_server_had_cached(encoder):
    gateway, _ = gateway_over(encoder, [])
    gateway.scheduler.backend = CachingBackend([sampled(encoder, "Sunny.")] * 3)
    async with gateway.serving():
        chat = await client(gateway, gateway.open_session()).chat.completions.create(model="p", messages=PROMPT)
        responses = await client(gateway, gateway.open_session()).responses.create(model="p", input=PROMPT)
        message = await anthropic_client(gateway, gateway.open_session()).messages.create(
            model="p", max_tokens=64, system=PROMPT[0]["content"], messages=PROMPT[1:]
        )
    assert chat.usage.prompt_tokens_details.cached_tokens == chat.usage.prompt_tokens - 7
    assert responses.usage.input_tokens_details.cached_tokens == responses.usage.input_tokens - 7
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (7, chat.usage.prompt_tokens - 7)


@pytest.mark.anyio
async def test_anthropic_count_tokens_counts_the_prompt_as_the_template_renders_it(encoder):
    gateway, backend = gateway_over(encoder, [])
    async with gateway.serving():
        session = gateway.open_session()
        counted = await anthropic_client(gateway, session).messages.count_tokens(
            model="policy", system=PROMPT[0]["content"], messages=PROMPT[1:], tools=ANTHROPIC_TOOLS
        )
        async with httpx2.AsyncClient(base_url=gateway.url, headers={"x-api-key": session.key}) as http:
            elsewhere = await http.get(f"/sessions/{session.id}/v1/models")
    expected = encoder.for_tools(TOOLS).encode_prompt(PROMPT).token_ids
    assert counted.input_tokens == len(expected) and backend.requests == []  # counted, nothing generated
    assert elsewhere.status_code == 404 and elsewhere.json()["error"]["type"] == "not_found_error"


@pytest.mark.anyio
async def test_parts_and_messages_of_older_or_other_kinds_are_served_or_left_out_and_counted(encoder):
    """An audio part is left out of a text policy's prompt and counted, not refused; the deprecated function calling
    (an assistant's `function_call`, a `function` message) is a tool call and its result."""
    gateway, backend = gateway_over(encoder, [sampled(encoder, "Sunny.")])
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    asked = [
        {"role": "user", "content": [{"type": "text", "text": "How is the weather in Paris?"}, audio]},
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"role": "function", "name": "get_weather", "content": "Sunny, 24 C."},
    ]
    async with gateway.serving():
        reply = await client(gateway, gateway.open_session()).chat.completions.create(model="p", messages=asked)
    assert reply.choices[0].message.content == "Sunny." and gateway.counts["degraded:part:input_audio"] == 1
    prompt = encoder.tokenizer.decode(backend.requests[0].input_ids)
    assert "How is the weather in Paris?" in prompt and "Sunny, 24 C." in prompt and "get_weather" in prompt
