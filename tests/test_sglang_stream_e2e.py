"""SGLangBackend streaming against a real SGLang server on CPU (tests/sglang_cpu/): the session's servers stream
cumulative chunks (SGLang's default), and one started here with `--incremental-streaming-output` streams
incremental ones. Each listener gets every token once, the first ones while the request still runs (an abort sent
from the listener's first tokens cuts the generation short), and the result is the unstreamed one."""

from __future__ import annotations

import anyio
import httpx2
import pytest

from engine.backends.base import SamplingParams
from engine.backends.sglang import SGLangBackend
from tests.fakes import Listener
from tests.sglang_cpu.server import SGLangServer

pytestmark = pytest.mark.sglang

PROMPT = [9707, 11, 1052, 374, 264, 3364, 25]  # ordinary text tokens of the Qwen vocabulary
GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
ENDLESS = SamplingParams(max_new_tokens=4000, temperature=1.0, ignore_eos=True)  # runs until aborted


@pytest.fixture(scope="module")
def incremental_server(sglang_workers):
    """An SGLang server of the session's model whose chunks hold only what is new."""
    with SGLangServer(sglang_workers[0].model_path, extra=("--incremental-streaming-output",)) as server:
        yield server


@pytest.fixture(params=["cumulative", "incremental"])
def url(request, sglang_workers):
    if request.param == "cumulative":
        return sglang_workers[0].url
    return request.getfixturevalue("incremental_server").url


@pytest.mark.anyio
async def test_a_streamed_generation_is_the_unstreamed_one(url):
    listener = Listener()
    async with SGLangBackend(url, timeout=120) as backend:
        streamed = await backend.generate(PROMPT, GREEDY, on_tokens=listener)
        whole = await backend.generate(PROMPT, GREEDY)
    assert listener.tokens == streamed.token_ids == whole.token_ids and len(streamed.token_ids) == 24
    assert len(listener.calls) > 1  # in pieces, as the server made them
    assert streamed.logprobs == pytest.approx(whole.logprobs, abs=1e-3)
    assert (streamed.finish_reason, streamed.prompt_tokens, streamed.weight_version) == (
        "length", len(PROMPT), whole.weight_version,
    )  # fmt: skip
    assert streamed.text == whole.text


@pytest.mark.anyio
async def test_the_first_tokens_arrive_while_the_server_generates(url):
    """The listener's first tokens trigger an abort: the generation ends long before its 4,000 tokens, with
    exactly the tokens the listener got."""
    listener, results = Listener(), []
    async with SGLangBackend(url, timeout=120) as backend:

        async def run() -> None:
            results.append(await backend.generate(PROMPT, ENDLESS, rid="long", on_tokens=listener))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(run)
                await listener.reached(4).wait()
                assert not results
                await backend.abort("long")
    (result,) = results
    assert result.finish_reason == "abort" and 4 <= len(result.token_ids) < 4000
    assert listener.tokens == result.token_ids and len(result.logprobs) == len(result.token_ids)


@pytest.mark.anyio
async def test_a_pause_in_abort_mode_ends_the_stream_with_its_tokens(url):
    listener, results = Listener(), []
    async with SGLangBackend(url, timeout=120) as backend:

        async def run() -> None:
            results.append(await backend.generate(PROMPT, ENDLESS, on_tokens=listener))

        try:
            with anyio.fail_after(120):
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(run)
                    await listener.reached(4).wait()
                    await backend.pause(mode="abort")
        finally:
            await backend.resume()
        again = await backend.generate(PROMPT, GREEDY, on_tokens=Listener())
    (result,) = results
    assert result.finish_reason == "abort" and listener.tokens == result.token_ids
    assert again.finish_reason == "length"


def test_sglangs_chunks_have_the_shape_a_cumulative_chunk_is_read_by(sglang_workers):
    """A cumulative chunk not finished is read off the end of its `output_ids` (engine/backends/sglang_stream.py):
    SGLang writes each chunk as compact JSON, `"output_ids":[...]` and `"finish_reason":null` as such."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}, "stream": True,
            "return_logprob": True}  # fmt: skip
    with httpx2.stream("POST", f"{sglang_workers[0].url}/generate", json=body, timeout=120) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    *chunks, done = events
    assert done == "[DONE]" and len(chunks) > 1
    for chunk in chunks[:-1]:
        assert '"output_ids":[' in chunk and '"finish_reason":null' in chunk
    assert '"finish_reason":null' not in chunks[-1]
