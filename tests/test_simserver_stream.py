"""The simulated SGLang server's streamed replies (benchmarks/longtail/simserver.py), one server and many, cumulative
and incremental, read by the real SGLangBackend: the tokens of the unstreamed reply, paced as they are made."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from benchmarks.longtail.model import IM_END, IM_START
from benchmarks.longtail.simserver import Fleet, SimConfig, SimServer
from engine.backends.base import SamplingParams
from engine.backends.sglang import SGLangBackend

PARAMS = SamplingParams(max_new_tokens=1024, stop_token_ids=(IM_END,))
TURN = 24
PROMPT = [IM_START, 872, 198, 1001, 2001, IM_END, 198, IM_START, 77091, 198]
MODES = pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])


@contextlib.asynccontextmanager
async def serving(sim: SimServer | Fleet) -> AsyncIterator[str]:
    runner = web.AppRunner(sim.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    loop_task = asyncio.create_task(sim.batch_loop()) if isinstance(sim, SimServer) else None
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        if loop_task is not None:
            loop_task.cancel()
        await runner.cleanup()


def config(incremental: bool, **overrides) -> SimConfig:
    return SimConfig(
        max_running=4, decode_a=0.002, decode_b=0.0, prefill_s_per_token=0.0, median_tokens=TURN, sigma=0.0,
        incremental_streaming_output=incremental, **overrides,
    )  # fmt: skip


@pytest.mark.anyio
@MODES
async def test_one_server_streams_a_chunk_a_step_and_the_tokens_of_its_unstreamed_reply(incremental):
    sim = SimServer(config(incremental))
    calls, running_at_first_call = [], []

    def listener(token_ids: list[int]) -> None:
        if not calls:
            running_at_first_call.append(len(sim.running))
        calls.append(token_ids)

    async with serving(sim) as url, SGLangBackend(url, timeout=30) as backend:
        streamed = await backend.generate(PROMPT, PARAMS, on_tokens=listener)
        sim.reset_state("v0")  # the model's turns again from the start
        whole = await backend.generate(PROMPT, PARAMS)
    assert [t for call in calls for t in call] == streamed.token_ids == whole.token_ids
    assert len(streamed.token_ids) == TURN and streamed.finish_reason == whole.finish_reason == "stop"
    assert streamed.logprobs == whole.logprobs
    assert running_at_first_call == [1]  # the first tokens came while the request still ran
    assert len(calls) > TURN // 2  # paced: about a chunk a step, not one at the end
    assert isinstance(streamed.meta["first_chunk_at"], float)  # when the server sent the first chunk


@pytest.mark.anyio
@MODES
async def test_many_servers_stream_each_token_at_its_due_time(incremental):
    sim = Fleet(config(incremental, servers=2, kv_tokens=4096))
    calls, running_at_first_call = [], []

    def listener(token_ids: list[int]) -> None:
        if not calls:
            running_at_first_call.append(len(sim.servers[1].running))
        calls.append(token_ids)

    async with serving(sim) as url, SGLangBackend(f"{url}/s/1", timeout=30) as backend:
        streamed = await backend.generate(PROMPT, PARAMS, on_tokens=listener)
        sim.reset("v0")
        whole = await backend.generate(PROMPT, PARAMS)
    assert [t for call in calls for t in call] == streamed.token_ids == whole.token_ids
    assert len(streamed.token_ids) == TURN and streamed.logprobs == whole.logprobs
    assert running_at_first_call == [1] and len(calls) > TURN // 2
