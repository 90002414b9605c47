"""The session gateway over the real topology: the official `openai` SDK, unmodified, against sessions whose
turns generate on two real SGLang servers on CPU behind the real sglang-router (as slime routes sessions, by
`X-SMG-Routing-Key` under `consistent_hashing`). Two agents at once, three requests each, the third sent while
generation is paused for a weight update. What it checks, from the servers' own replies and logs: each turn's
tokens and log-probs are the server's, mask 1 exactly on them; each chain's turns reached one worker; the
paused request is answered after the resume, with no error to the agent."""

from __future__ import annotations

import anyio
import openai
import pytest

from engine.agents.gateway import Gateway
from engine.backends.base import SamplingParams
from engine.backends.sglang import SGLangBackend
from engine.encoding import ChatEncoder
from engine.scheduler.retry import CircuitBreaker, RetryPolicy
from engine.scheduler.scheduler import Scheduler
from engine.trajectory import Status
from engine.turn import TurnLimits
from tests.router import SGLangRouter
from tests.test_sglang_router_e2e import sessions_by_worker

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def router(sglang_workers):
    with SGLangRouter([w.url for w in sglang_workers], policy="consistent_hashing") as running:
        yield running


@pytest.mark.anyio
async def test_two_agents_through_the_router_keep_their_tokens_and_their_worker(router, sglang_workers):
    from engine.models import load_processor

    processor = load_processor(str(sglang_workers[0].model_path))
    encoder = ChatEncoder(processor.tokenizer, processor=processor)
    async with SGLangBackend(router.url, timeout=300) as backend:
        scheduler = Scheduler(
            backend=backend, encoder=encoder,
            sampling=SamplingParams(max_new_tokens=12, stop_token_ids=encoder.stop_token_ids),
            limits=TurnLimits(max_turns=8), retry=RetryPolicy(env_step_timeout_s=600), breaker=CircuitBreaker(),
            max_generating=4, max_env_steps=4,
        )  # fmt: skip
        gateway = Gateway(scheduler)
        async with gateway.serving():
            sessions = [gateway.open_session() for _ in range(2)]
            clients = [openai.AsyncOpenAI(base_url=gateway.base_url(s), api_key=s.key, max_retries=0) for s in sessions]
            histories = [[{"role": "user", "content": f"Tell me a story about the number {i}."}] for i in range(2)]

            streamed: list[int] = []

            async def ask(i: int) -> None:
                if i == 1:  # this agent streams: its reply as SGLang streams the turn's tokens
                    stream = await clients[i].chat.completions.create(
                        model="policy", messages=histories[i], stream=True
                    )
                    deltas = [
                        c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content
                    ]
                    streamed.append(len(deltas))
                    histories[i] += [{"role": "assistant", "content": "".join(deltas)}]
                else:
                    reply = await clients[i].chat.completions.create(model="policy", messages=histories[i])
                    histories[i] += [reply.choices[0].message.model_dump(exclude_none=True)]
                histories[i] += [{"role": "user", "content": "Go on."}]

            for _ in range(2):
                async with anyio.create_task_group() as tasks:
                    for i in range(2):
                        tasks.start_soon(ask, i)
            await scheduler.pause_generation()  # a weight update: the third requests wait for it
            async with anyio.create_task_group() as tasks:
                for i in range(2):
                    tasks.start_soon(ask, i)
                while scheduler.num_parked < 2:
                    await scheduler.parked_or_ended()
                scheduler.resume_generation(await backend.weight_version())
            chains = [await gateway.finish(s.id) for s in sessions]
            for agent in clients:
                await agent.close()
    assert len(streamed) == 3 and sum(streamed) > 3  # sent as generated, not whole at the turn's end
    routed = sessions_by_worker(sglang_workers)
    for (trajectory,) in chains:  # no fork: each agent's history continued its chain
        assert trajectory.status == Status.COMPLETED and len(trajectory.turns) == 3
        trajectory.check_invariant()
        mask, logprobs = list(trajectory.loss_mask), list(trajectory.logprobs)
        model = {i for t in trajectory.turns for i in range(t.start, t.start + t.num_generated)}
        assert [i for i, m in enumerate(mask) if m == 1] == sorted(model)
        assert all((logprobs[i] != 0.0) for i in model)  # the server's log-probs, kept where the model sampled
        assert len(routed[trajectory.session_id]) == 1, routed[trajectory.session_id]  # one worker throughout
