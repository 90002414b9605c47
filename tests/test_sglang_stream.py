"""SGLangBackend streaming (engine/backends/sglang_stream.py): against the SGLang double's streamed replies, in
SGLang's cumulative chunks (its default) and incremental ones (`--incremental-streaming-output`); the real server
is in tests/test_sglang_stream_e2e.py."""

from __future__ import annotations

import json
from dataclasses import replace

import anyio
import pytest

from engine.backends.base import STREAM_BROKEN, GenerateResult, SamplingParams, can_stream
from engine.backends.sglang import SGLangBackend
from engine.backends.sglang_stream import EventSplitter, StreamedGeneration
from engine.encoding import ChatEncoder
from engine.envs.base import EnvRunner
from engine.errors import BackendError, ErrorClass
from engine.scheduler.retry import CircuitBreaker, RetryPolicy
from engine.scheduler.scheduler import Scheduler
from engine.trajectory import Status, Trajectory
from engine.turn import TurnLimits
from tests.fakes import Listener, ScriptedEnv
from tests.sglang_double import Generate, Raw, SGLangDouble

PARAMS = SamplingParams(max_new_tokens=64)
TOKENS = list(range(100, 112))
MODES = pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])


@pytest.fixture
def server(incremental):
    with SGLangDouble(incremental_stream=incremental) as double:
        yield double


@pytest.fixture
async def backend(server):
    async with SGLangBackend(server.url, timeout=10) as client:
        yield client


def comparable(result: GenerateResult) -> GenerateResult:
    """The result without what differs between two requests of one reply: the latency, the request id."""
    return replace(result, meta={k: v for k, v in result.meta.items() if k not in ("e2e_latency", "id")})


def chunk(ids: list[int], total: int, finish: str | dict | None = None, **meta) -> bytes:
    """One streamed chunk's data, in SGLang's compact JSON."""
    entries = [[-0.5, t, None] for t in ids]
    body = {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": finish} if isinstance(finish, str) else finish, "prompt_tokens": 3,
            "cached_tokens": 0, "completion_tokens": total, "output_token_logprobs": entries, **meta,
        },
    }  # fmt: skip
    return json.dumps(body, separators=(",", ":")).encode()


def events(*chunks: bytes, done: bool = True) -> bytes:
    return b"".join(b"data: " + c + b"\n\n" for c in chunks) + (b"data: [DONE]\n\n" if done else b"")


# -- the result and the listener ------------------------------------------------------------------


def test_the_backend_streams():
    assert can_stream(SGLangBackend("http://127.0.0.1:1"))


@pytest.mark.anyio
@MODES
@pytest.mark.parametrize("chunk_tokens", [1, 5])
async def test_the_listener_gets_every_token_once_and_the_result_is_the_unstreamed_one(server, backend, chunk_tokens):
    spec = Generate(token_ids=TOKENS, text="twelve tokens", weight_version="v7", cached_tokens=2)
    server.script(replace(spec, chunk_tokens=chunk_tokens), spec)
    listener = Listener()

    streamed = await backend.generate([1, 2, 3], PARAMS, rid="r", on_tokens=listener)
    whole = await backend.generate([1, 2, 3], PARAMS, rid="r")

    assert listener.tokens == streamed.token_ids == TOKENS
    assert len(listener.calls) == -(-len(TOKENS) // chunk_tokens)  # a call per chunk
    assert comparable(streamed) == comparable(whole)
    first, second = (r.body for r in server.requests_to("/generate"))
    assert first["stream"] is True and "stream" not in second  # no listener: the request is as it always was


@pytest.mark.anyio
@MODES
async def test_the_first_tokens_arrive_while_the_generation_runs(server, backend):
    """The server holds after 3 tokens: the listener has them while the request still runs, and an abort then
    ends it with exactly those."""
    server.script(Generate(token_ids=TOKENS, stream_hold_after=3))
    listener, results = Listener(), []

    async def run() -> None:
        results.append(await backend.generate([1], PARAMS, rid="r", on_tokens=listener))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await listener.reached(3).wait()
            assert not results and server.num_held == 1  # still generating
            await backend.abort("r")

    assert (results[0].finish_reason, results[0].token_ids, listener.tokens) == ("abort", TOKENS[:3], TOKENS[:3])
    assert len(results[0].logprobs) == 3 and STREAM_BROKEN not in results[0].meta


@pytest.mark.anyio
@MODES
async def test_a_pause_in_abort_mode_mid_stream_keeps_the_tokens(server, backend):
    server.script(Generate(token_ids=TOKENS, stream_hold_after=4))
    listener, results = Listener(), []

    async def run() -> None:
        results.append(await backend.generate([1], PARAMS, on_tokens=listener))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await listener.reached(4).wait()
            await backend.pause(mode="abort")

    assert (results[0].finish_reason, results[0].token_ids) == ("abort", TOKENS[:4])
    assert listener.tokens == TOKENS[:4]


@pytest.mark.anyio
@MODES
async def test_a_listener_that_raises_is_dropped_and_the_generation_goes_on(server, backend, caplog):
    server.script(Generate(token_ids=TOKENS))
    calls = []

    def failing(token_ids: list[int]) -> None:
        calls.append(token_ids)
        raise RuntimeError("the client went away")

    result = await backend.generate([1], PARAMS, on_tokens=failing)
    assert result.token_ids == TOKENS and result.finish_reason == "stop"
    assert calls == [TOKENS[:1]]
    assert "a token listener raised" in caplog.text


# -- a stream that breaks ---------------------------------------------------------------------------


@pytest.mark.anyio
@MODES
async def test_a_stream_dropped_mid_way_returns_what_came_as_an_abort(server, backend):
    server.script(Generate(token_ids=TOKENS, stream_break_after=5))
    listener = Listener()
    result = await backend.generate([1, 2], PARAMS, on_tokens=listener)
    assert (result.finish_reason, result.token_ids, listener.tokens) == ("abort", TOKENS[:5], TOKENS[:5])
    assert result.logprobs == pytest.approx([-0.1 * (i + 1) for i in range(5)])
    assert "connection" in result.meta[STREAM_BROKEN].lower() or "ended" in result.meta[STREAM_BROKEN]
    assert result.prompt_tokens == 2


@pytest.mark.anyio
@MODES
async def test_a_stream_dropped_before_any_token_is_an_error(server, backend):
    server.script(Generate(token_ids=TOKENS, stream_break_after=0))
    listener = Listener()
    with pytest.raises(BackendError) as info:
        await backend.generate([1], PARAMS, on_tokens=listener)
    assert info.value.error_class is ErrorClass.CONNECTION
    assert listener.calls == []


# -- errors -----------------------------------------------------------------------------------------


OVERLOADED = {"type": "abort", "status_code": 503, "message": "overloaded"}


@pytest.mark.anyio
@pytest.mark.parametrize("incremental", [False])
@pytest.mark.parametrize(
    ("stream", "error_class", "expected"),
    [
        (b'data: {"error": {"message": "prompt too long"}}\n\ndata: [DONE]\n\n', ErrorClass.CLIENT, "prompt too long"),
        (events(chunk([], 0, OVERLOADED)), ErrorClass.SERVER, "overloaded"),
        (events(done=False), ErrorClass.CONNECTION, "ended before its last chunk"),
    ],
    ids=["error-chunk", "abort-with-status", "no-last-chunk"],
)
async def test_errors_in_the_stream_before_any_token_are_classified(server, backend, stream, error_class, expected):
    server.script(Raw(200, stream, "text/event-stream"))
    with pytest.raises(BackendError) as info:
        await backend.generate([1], PARAMS, on_tokens=Listener())
    assert info.value.error_class is error_class and expected in info.value.message


@pytest.mark.anyio
@pytest.mark.parametrize("incremental", [False])
@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        (events(chunk([7], 1), b"{not json"), "not JSON"),
        (events(chunk([7], 1), chunk([7], 1, OVERLOADED)), "HTTP 503 in the stream"),
        (events(chunk([7], 1), done=False), "ended before its last chunk"),
    ],
    ids=["malformed", "abort-with-status", "no-last-chunk"],
)
async def test_a_stream_that_fails_after_tokens_ends_with_them(server, backend, stream, expected):
    server.script(Raw(200, stream, "text/event-stream"))
    listener = Listener()
    result = await backend.generate([1], PARAMS, on_tokens=listener)
    assert (result.finish_reason, result.token_ids, listener.tokens) == ("abort", [7], [7])
    assert expected in result.meta[STREAM_BROKEN]


@pytest.mark.anyio
@MODES
async def test_an_error_status_is_the_error_it_is_unstreamed(server, backend):
    server.script(Generate(status=503))
    listener = Listener()
    with pytest.raises(BackendError) as info:
        await backend.generate([1], PARAMS, on_tokens=listener)
    assert info.value.error_class is ErrorClass.SERVER and listener.calls == []


@pytest.mark.anyio
@pytest.mark.parametrize("incremental", [False])
async def test_a_reply_that_is_not_a_stream_is_read_whole_and_handed_over_at_once(server, backend):
    server.script(Raw(200, json.loads(chunk([4, 5, 6], 3, "stop"))))
    listener = Listener()
    result = await backend.generate([1], PARAMS, on_tokens=listener)
    assert result.token_ids == [4, 5, 6] and listener.calls == [[4, 5, 6]]


@pytest.mark.anyio
@MODES
async def test_a_prompt_the_server_expanded_otherwise_fails_before_any_token_is_handed_over(server):
    pad, start, end = 151655, 151652, 151653
    prompt = [1, start, pad, pad, end, 2]
    server.script(Generate(token_ids=[7, 8], prompt_tokens=5))
    listener = Listener()
    async with SGLangBackend(server.url, image_token_id=pad) as backend:
        with pytest.raises(BackendError) as info:
            await backend.generate(prompt, PARAMS, image_data=["a"], on_tokens=listener)
    assert info.value.error_class is ErrorClass.CLIENT and listener.calls == []


# -- the chunks, read -------------------------------------------------------------------------------


def test_events_split_off_a_byte_stream_at_any_boundary():
    raw = b"data: " + chunk([1], 1) + b"\n\n" + b"data: " + chunk([1, 2], 2) + b"\n\ndata: [DONE]\n\n"
    splitter, events = EventSplitter(), []
    for i in range(len(raw)):
        events += splitter.feed(raw[i : i + 1])
    assert events == [chunk([1], 1), chunk([1, 2], 2), b"[DONE]"]


def test_cumulative_chunks_are_told_by_their_counts_and_read_without_parsing_the_rest():
    stream = StreamedGeneration()
    assert stream.add(chunk([1], 1)) == [1] and stream.is_cumulative is None
    assert stream.add(chunk([1, 2, 3], 3)) == [2, 3] and stream.is_cumulative is True
    # from now on a chunk not finished is read off its output_ids only: the rest need not even parse
    assert stream.add(chunk([1, 2, 3, 4], 4)[:-40]) == [4]
    assert stream.add(chunk([1, 2, 3, 4, 5], 5, "stop")) == [5]
    assert stream.result.token_ids == [1, 2, 3, 4, 5] and stream.result.finish_reason == "stop"
    assert stream.result.logprobs == [-0.5] * 5


def test_the_last_cumulative_chunk_must_hold_the_ids_read_off_the_ones_before():
    stream = StreamedGeneration()
    stream.add(chunk([1], 1))
    stream.add(chunk([1, 2], 2))
    stream.add(chunk([1, 2, 9], 3))
    with pytest.raises(ValueError, match="differ"):
        stream.add(chunk([1, 2, 3, 4], 4, "stop"))


def test_incremental_chunks_and_an_abort_repeating_the_last_token_give_each_token_once():
    """SGLang's abort of a queued request, in an incremental stream, repeats the last output id and sends the log-
    probs whole (tokenizer_manager.py `_handle_abort_req`): the counts say nothing is new."""
    stream = StreamedGeneration()
    assert stream.add(chunk([1], 1)) == [1]
    assert stream.add(chunk([2, 3], 3)) == [2, 3] and stream.is_cumulative is False
    final = json.loads(chunk([1, 2, 3], 3, "abort"))
    final["output_ids"] = [3]
    assert stream.add(json.dumps(final).encode()) == []
    assert stream.result.token_ids == [1, 2, 3] and stream.result.finish_reason == "abort"


def test_a_break_after_a_skimmed_chunk_reads_its_logprobs_then():
    stream = StreamedGeneration()
    stream.add(chunk([1], 1))
    stream.add(chunk([1, 2], 2))
    stream.add(chunk([1, 2, 3], 3, weight_version="v2"))
    broken = stream.broken("the server went away")
    assert (broken.token_ids, broken.logprobs, broken.finish_reason) == ([1, 2, 3], [-0.5] * 3, "abort")
    assert broken.meta[STREAM_BROKEN] == "the server went away" and broken.weight_version == "v2"
    assert StreamedGeneration().broken("nothing came") is None


# -- through the scheduler --------------------------------------------------------------------------


@pytest.mark.anyio
@MODES
async def test_a_turn_whose_stream_broke_goes_on_from_its_tokens_and_streams_each_once(server, backend, tokenizer):
    encoder = ChatEncoder(tokenizer)
    end = encoder.end_of_turn_id
    server.script(Generate(token_ids=[11, 12, 13, 14], stream_break_after=3), Generate(token_ids=[21, 22, end]))
    scheduler = Scheduler(
        backend=backend, encoder=encoder, sampling=SamplingParams(max_new_tokens=32, stop_token_ids=(end,)),
        limits=TurnLimits(max_turns=2), retry=RetryPolicy(backoff_base_s=0.0, env_step_timeout_s=None),
        breaker=CircuitBreaker(), max_generating=1, max_env_steps=1, end_on_abort=True,
    )  # fmt: skip
    trajectory, listener = Trajectory(prompt=[{"role": "user", "content": "Count."}]), Listener()
    trajectory.token_listener = listener
    await scheduler.drive(trajectory, lambda: EnvRunner(ScriptedEnv([{"role": "user", "content": "done"}])))
    assert trajectory.status is Status.COMPLETED and len(trajectory.turns) == 1
    assert listener.tokens == trajectory.generated_ids(trajectory.turns[0]).tolist() == [11, 12, 13, 21, 22, end]
    assert scheduler.statistics().retries == {ErrorClass.SERVER: 1}
    first, second = (r.body for r in server.requests_to("/generate"))
    assert second["input_ids"] == [*first["input_ids"], 11, 12, 13]
