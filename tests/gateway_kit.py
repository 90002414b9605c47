"""What the gateway's tests share: a gateway over a scripted policy (the sampled tokens are known), the agent's
clients for a session (its key, closed by `closes_clients` in the test's loop), and the checks on what a
session leaves (the sampled tokens, mask 1 exactly on them)."""

from __future__ import annotations

import anthropic
import openai
import pytest

from engine.agents.gateway import Gateway
from engine.backends.base import SamplingParams
from engine.encoding import ChatEncoder
from engine.scheduler.retry import CircuitBreaker, RetryPolicy
from engine.scheduler.scheduler import Scheduler
from engine.turn import TurnLimits
from tests.fakes import ScriptedBackend

PROMPT = [
    {"role": "system", "content": "You answer questions about the weather."},
    {"role": "user", "content": "How is the weather in Paris?"},
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def sampled(encoder: ChatEncoder, text: str) -> list[int]:
    return [*encoder.tokenizer(text, add_special_tokens=False)["input_ids"], encoder.end_of_turn_id]


def gateway_over(
    encoder: ChatEncoder,
    replies: list,
    retry: RetryPolicy | None = None,
    max_env_steps: int = 64,
    limits: TurnLimits | None = None,
    **options,
) -> tuple[Gateway, ScriptedBackend]:
    backend = ScriptedBackend(replies)
    scheduler = Scheduler(
        backend=backend, encoder=encoder,
        sampling=SamplingParams(max_new_tokens=256, stop_token_ids=encoder.stop_token_ids),
        limits=limits or TurnLimits(max_turns=16), retry=retry or RetryPolicy(env_step_timeout_s=60),
        breaker=CircuitBreaker(), max_generating=4, max_env_steps=max_env_steps,
    )  # fmt: skip
    return Gateway(scheduler, **options), backend


OPEN_CLIENTS: list[openai.AsyncOpenAI | anthropic.AsyncAnthropic] = []


def key_of(session) -> str:
    return getattr(session, "key", "unused")


def client(gateway: Gateway, session, **options) -> openai.AsyncOpenAI:
    """The agent's OpenAI client for its session, with its key."""
    agent = openai.AsyncOpenAI(
        base_url=gateway.base_url(session), api_key=key_of(session), **{"max_retries": 0, **options}
    )
    OPEN_CLIENTS.append(agent)
    return agent


def anthropic_client(gateway: Gateway, session, **options) -> anthropic.AsyncAnthropic:
    """The agent's Anthropic client for its session, with its key."""
    agent = anthropic.AsyncAnthropic(
        base_url=gateway.base_url(session, "anthropic"), api_key=key_of(session), **{"max_retries": 0, **options}
    )
    OPEN_CLIENTS.append(agent)
    return agent


@pytest.fixture(autouse=True)
async def closes_clients():
    yield
    while OPEN_CLIENTS:
        await OPEN_CLIENTS.pop().close()


def answered(asked: list[dict], choice, result: str = "Sunny, 24 C.") -> list[dict]:
    """What an agent sends next: its conversation, the reply as the SDK parsed it, its tool's result."""
    call = choice.message.tool_calls[0]
    tool = {"role": "tool", "tool_call_id": call.id, "content": result}
    return [*asked, choice.message.model_dump(exclude_none=True), tool]


def assert_sampled_exactly(trajectory, turns: list[list[int]]) -> None:
    """The response holds each sampled turn as sampled, mask 1 and its log-probs exactly there."""
    trajectory.check_invariant()
    response, mask = list(trajectory.response_ids), list(trajectory.loss_mask)
    assert [response[t.start : t.start + t.num_generated] for t in trajectory.turns] == turns
    model = {i for t in trajectory.turns for i in range(t.start, t.start + t.num_generated)}
    assert [i for i, m in enumerate(mask) if m == 1] == sorted(model)
    assert all((trajectory.logprobs[i] == -0.5) == (i in model) for i in range(len(mask)))
