"""SGLangBackend against a local server that answers in SGLang's shape (tests/sglang_double.py); the same
backend behind a real sglang-router is tests/test_sglang_router.py."""

from __future__ import annotations

import anyio
import httpx2
import pytest

from engine.backends.base import Backend, SamplingParams
from engine.backends.sglang import SGLangBackend
from engine.errors import BackendError, ErrorClass
from tests.net import free_port
from tests.sglang_double import Disconnect, Generate, Raw, SGLangDouble, error_body

PARAMS = SamplingParams(max_new_tokens=8)


@pytest.fixture
def server():
    with SGLangDouble() as double:
        yield double


@pytest.fixture
async def backend(server):
    async with SGLangBackend(server.url) as client:
        yield client


def closed_port_url() -> str:
    """The URL of a port nothing listens on."""
    return f"http://127.0.0.1:{free_port()}"


async def wait_held(server: SGLangDouble, count: int) -> None:
    assert await anyio.to_thread.run_sync(server.wait_held, count), f"{count} requests were never held"


def sent(server: SGLangDouble) -> list[tuple[str, str, object]]:
    """What reached the server, without the GET /workers that told it from a router."""
    return [(r.method, r.path, r.body) for r in server.requests if r.path != "/workers"]


# -- the request ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_generate_sends_sglang_request_body(server, backend):
    params = SamplingParams(
        max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(151645,), stop=("</tool>",)
    )
    await backend.generate([1, 2, 3], params, ["data:image/png;base64,iVBORw0KGgo="], rid="traj-7-turn-2")
    await backend.generate((4, 5), SamplingParams(max_new_tokens=4, ignore_eos=True))

    first, second = (r.body for r in server.requests_to("/generate"))
    assert first == {
        "input_ids": [1, 2, 3],
        "sampling_params": params.to_sglang(),
        "return_logprob": True,
        "image_data": ["data:image/png;base64,iVBORw0KGgo="],
        "rid": f"{backend.rid_prefix}0-traj-7-turn-2",
    }
    assert first["sampling_params"].items() >= {
        "max_new_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "skip_special_tokens": True,
        "stop_token_ids": [151645], "stop": ["</tool>"],
    }.items()  # fmt: skip
    assert second == {
        "input_ids": [4, 5],
        "sampling_params": {
            "max_new_tokens": 4,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "skip_special_tokens": True,
            "ignore_eos": True,
        },
        "return_logprob": True,
        "rid": f"{backend.rid_prefix}1-",
    }
    assert all(r.method == "POST" for r in server.requests_to("/generate"))


def test_each_backend_has_its_own_rid_prefix():
    first, second = SGLangBackend("http://127.0.0.1:1"), SGLangBackend("http://127.0.0.1:1")
    assert first.rid_prefix.startswith("turnstile-") and first.rid_prefix.endswith("-")
    assert len(first.rid_prefix) == len("turnstile-12345678-")
    assert first.rid_prefix != second.rid_prefix


@pytest.mark.anyio
async def test_image_pads_go_one_per_image_and_must_expand_to_the_encoders_count(server):
    """SGLang expands each image's placeholder itself: each run of pads is sent as one, and the
    server's prompt length must match the encoder's expansion."""
    pad, start, end = 151655, 151652, 151653
    prompt = [1, start, pad, pad, pad, end, 2, start, pad, pad, end, 3]
    async with SGLangBackend(server.url, image_token_id=pad) as backend:
        server.script(Generate(token_ids=[7], prompt_tokens=len(prompt)), Generate(token_ids=[7], prompt_tokens=9))
        result = await backend.generate(prompt, SamplingParams(max_new_tokens=1), image_data=["a", "b"])
        assert result.token_ids == [7]
        sent = server.requests_to("/generate")[0].body["input_ids"]
        assert sent == [1, start, pad, end, 2, start, pad, end, 3]
        with pytest.raises(BackendError) as info:
            await backend.generate(prompt, SamplingParams(max_new_tokens=1), image_data=["a", "b"])
        assert info.value.error_class is ErrorClass.CLIENT
        assert "prompt of 9 tokens, the encoder into 12" in info.value.message
        await backend.generate(prompt, SamplingParams(max_new_tokens=1))  # no images: sent as is
        assert server.requests_to("/generate")[-1].body["input_ids"] == prompt


@pytest.mark.anyio
async def test_headers_go_with_every_request(server):
    async with SGLangBackend(server.url, headers={"Authorization": "Bearer k"}) as backend:
        await backend.generate([1], PARAMS)
        await backend.weight_version()
    assert [r.path for r in server.requests] == ["/workers", "/generate", "/model_info"]
    assert [r.headers.get("authorization") for r in server.requests] == ["Bearer k"] * 3


@pytest.mark.anyio
async def test_session_id_goes_as_the_routing_key_header(server, backend):
    await backend.generate([1], PARAMS, session_id="traj-3")
    await backend.generate([1], PARAMS)
    keys = [r.headers.get("x-smg-routing-key") for r in server.requests_to("/generate")]
    assert keys == ["traj-3", None]


def test_backend_satisfies_the_protocol():
    assert isinstance(SGLangBackend("http://127.0.0.1:1"), Backend)


# -- parsing the reply ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_generate_parses_tokens_logprobs_text_and_counts(server, backend):
    server.script(
        Generate(
            token_ids=[151644, 872, 151645],
            logprobs=[-0.25, -1.5, -0.0625],
            text="<|im_start|>user<|im_end|>",
            weight_version="step-12",
            cached_tokens=3,
        )
    )
    result = await backend.generate([9, 8, 7, 6, 5], PARAMS, rid="r-1")

    assert result.token_ids == [151644, 872, 151645]
    assert result.logprobs == [-0.25, -1.5, -0.0625]
    assert result.text == "<|im_start|>user<|im_end|>"
    assert result.finish_reason == "stop"
    assert result.weight_version == "step-12"
    assert result.prompt_tokens == 5
    assert result.cached_tokens == 3
    assert result.meta["id"] == f"{backend.rid_prefix}0-r-1"  # the request id the server saw
    assert result.meta["finish_reason"] == {"type": "stop", "matched": 151645}
    assert result.meta["completion_tokens"] == 3
    assert "e2e_latency" in result.meta
    assert not [key for key in result.meta if key.endswith("_logprobs")]


@pytest.mark.anyio
@pytest.mark.parametrize("finish", ["stop", "length", "abort"])
async def test_generate_parses_each_finish_reason(server, backend, finish):
    server.script(Generate(token_ids=[3, 4], finish=finish))
    result = await backend.generate([1], PARAMS)
    assert result.finish_reason == finish
    assert result.token_ids == [3, 4]
    assert result.meta["finish_reason"]["type"] == finish


@pytest.mark.anyio
async def test_abort_before_prefill_reply_without_counts_is_zero_tokens(server, backend):
    """SGLang answers a request aborted in the waiting queue with little more than the finish reason."""
    server.script(
        Generate(
            token_ids=[],
            finish="abort",
            drop=("text", "meta_info.prompt_tokens", "meta_info.cached_tokens", "meta_info.output_token_logprobs"),
        )
    )
    result = await backend.generate([1, 2], PARAMS)
    assert (result.finish_reason, result.token_ids, result.logprobs, result.text) == ("abort", [], [], "")
    assert result.weight_version == "default"


# -- errors --------------------------------------------------------------------------------------

LONG_PROMPT = "The input (40000 tokens) is longer than the model's context length (32768 tokens)."

ERROR_CASES = [
    pytest.param(
        Raw(500, error_body(500, "Internal server error: CUDA out of memory")),
        ErrorClass.SERVER,
        ["HTTP 500", "CUDA out of memory"],
        id="http-500",
    ),
    pytest.param(
        Raw(503, error_body(503, "The request queue is full.")),
        ErrorClass.SERVER,
        ["HTTP 503", "The request queue is full."],
        id="http-503",
    ),
    pytest.param(
        Raw(400, error_body(400, LONG_PROMPT)), ErrorClass.CLIENT, ["HTTP 400", "longer than the model"], id="http-400"
    ),
    pytest.param(Raw(404, {"detail": "Not Found"}), ErrorClass.CLIENT, ["HTTP 404", "Not Found"], id="http-404"),
    pytest.param(
        Raw(200, "<html><body>502 Bad Gateway</body></html>", "text/html"),
        ErrorClass.MALFORMED,
        ["not JSON", "502 Bad Gateway"],
        id="not-json",
    ),
    pytest.param(
        Raw(200, b'{"text": "cut of'), ErrorClass.MALFORMED, ["not JSON", '{"text": "cut of'], id="truncated-json"
    ),
    pytest.param(Raw(200, {"text": "hi"}), ErrorClass.MALFORMED, ["no meta_info", '"text": "hi"'], id="no-meta-info"),
    pytest.param(
        Generate(token_ids=[1, 2], drop=("meta_info.output_token_logprobs",)),
        ErrorClass.MALFORMED,
        ["output_token_logprobs is missing", '"output_ids": [1, 2]'],
        id="no-logprobs",
    ),
    pytest.param(
        Generate(drop=("meta_info.finish_reason",)),
        ErrorClass.MALFORMED,
        ["unknown finish_reason None"],
        id="no-finish-reason",
    ),
    pytest.param(Generate(drop=("text",)), ErrorClass.MALFORMED, ["no text", '"output_ids"'], id="no-text"),
    pytest.param(
        Generate(drop=("meta_info.prompt_tokens",)),
        ErrorClass.MALFORMED,
        ["meta_info.prompt_tokens"],
        id="no-prompt-tokens",
    ),
    pytest.param(
        Generate(token_ids=[7, 8, 9], output_ids=[7, 8]),
        ErrorClass.MALFORMED,
        ["output_ids has 2 tokens but output_token_logprobs has 3", '"output_ids": [7, 8]'],
        id="length-mismatch",
    ),
    pytest.param(
        Generate(token_ids=[1], logprobs=["high"]),
        ErrorClass.MALFORMED,
        ["bad output_token_logprobs entry"],
        id="logprob-not-a-number",
    ),
    pytest.param(
        Generate(finish="eos_token"),
        ErrorClass.MALFORMED,
        ["unknown finish_reason {'type': 'eos_token'}"],
        id="unknown-finish",
    ),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("reply", "error_class", "expected"), ERROR_CASES)
async def test_generate_errors_are_classified(server, backend, reply, error_class, expected):
    server.script(reply)
    with pytest.raises(BackendError) as info:
        await backend.generate([1, 2], PARAMS)

    error = info.value
    assert error.error_class is error_class
    assert error.retryable is (error_class is ErrorClass.SERVER)
    assert f"SGLang server at {server.url}" in error.message
    assert "POST /generate" in error.message
    for text in expected:
        assert text in error.message


@pytest.mark.anyio
async def test_error_message_carries_at_most_300_chars_of_the_body(server, backend):
    server.script(Raw(500, "E" * 5000, "text/plain"))
    with pytest.raises(BackendError) as info:
        await backend.generate([1], PARAMS)
    excerpt = info.value.message.split("reply: ", 1)[1]
    assert excerpt.startswith("E" * 200)
    assert len(excerpt) <= 300


@pytest.mark.anyio
async def test_non_200_reply_that_is_an_abort_is_a_result(server, backend):
    server.script(Generate(token_ids=[4, 5], finish="abort", status=503))
    result = await backend.generate([1], PARAMS)
    assert (result.finish_reason, result.token_ids) == ("abort", [4, 5])


@pytest.mark.anyio
async def test_non_200_error_body_mentioning_abort_stays_an_error(server, backend):
    server.script(Raw(503, error_body(503, "The request is aborted by a higher priority request.")))
    with pytest.raises(BackendError) as info:
        await backend.generate([1], PARAMS)
    assert info.value.error_class is ErrorClass.SERVER
    assert "aborted by a higher priority" in info.value.message


@pytest.mark.anyio
async def test_server_down_is_connection_error_naming_the_url():
    url = closed_port_url()
    backend = SGLangBackend(url, connect_timeout=2)  # not entered: generate needs nothing found out first
    try:
        with pytest.raises(BackendError) as info:
            await backend.generate([1], PARAMS)
    finally:
        await backend.aclose()
    assert info.value.error_class is ErrorClass.CONNECTION
    assert info.value.retryable
    assert info.value.message.startswith(f"SGLang server at {url} is unreachable: POST /generate")


@pytest.mark.anyio
async def test_entering_an_unreachable_url_is_one_error_saying_what_was_tried():
    url = closed_port_url()
    backend = SGLangBackend(url, connect_timeout=2)
    with pytest.raises(BackendError) as info:
        await backend.__aenter__()
    assert info.value.error_class is ErrorClass.CONNECTION
    message = info.value.message
    assert message.startswith(f"SGLang server at {url} is unreachable: GET /workers: ConnectError")
    assert message.endswith("(asked to tell an SGLang server from an sglang-router)")
    with pytest.raises(RuntimeError):  # the failed enter closed it
        await backend.generate([1], PARAMS)


@pytest.mark.anyio
async def test_a_single_server_is_found_out_once(server):
    async with SGLangBackend(server.url) as backend:
        assert backend.is_router is False
        await backend.pause()
        await backend.weight_version()
    assert [r.path for r in server.requests] == ["/workers", "/pause_generation", "/model_info"]
    assert server.requests_to("/workers")[0].method == "GET"


@pytest.mark.anyio
async def test_control_calls_find_out_lazily_without_entering(server):
    backend = SGLangBackend(server.url)
    try:
        assert backend.is_router is None
        assert await backend.weight_version() == "default"
        assert backend.is_router is False
    finally:
        await backend.aclose()
    assert [r.path for r in server.requests] == ["/workers", "/model_info"]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("reply", "error_class", "expected"),
    [
        (Raw(200, {"workers": [{"no": "url"}]}), ErrorClass.MALFORMED, "not an sglang-router's worker list"),
        (Raw(200, {"workers": []}), ErrorClass.CONNECTION, "lists no workers"),
        (Raw(500, "boom", "text/plain"), ErrorClass.SERVER, "GET /workers: HTTP 500"),
    ],
)
async def test_a_url_that_is_neither_server_nor_router_with_workers_is_one_error(server, reply, error_class, expected):
    server.reply_next("/workers", reply)
    backend = SGLangBackend(server.url)
    with pytest.raises(BackendError) as info:
        await backend.__aenter__()
    assert info.value.error_class is error_class
    assert server.url in info.value.message and expected in info.value.message


@pytest.mark.anyio
async def test_server_closing_the_connection_is_connection_error(server, backend):
    server.script(Disconnect())
    with pytest.raises(BackendError) as info:
        await backend.generate([1], PARAMS)
    assert info.value.error_class is ErrorClass.CONNECTION
    assert f"SGLang server at {server.url} is unreachable" in info.value.message


@pytest.mark.anyio
async def test_request_timeout_is_timeout_error(server):
    server.script(Generate(hold=True))
    try:
        async with SGLangBackend(server.url, timeout=0.2) as backend:
            with anyio.fail_after(10), pytest.raises(BackendError) as info:
                await backend.generate([1], PARAMS)
    finally:
        server.release_all()
    assert info.value.error_class is ErrorClass.TIMEOUT
    assert info.value.retryable
    assert f"SGLang server at {server.url}: POST /generate" in info.value.message


@pytest.mark.anyio
async def test_control_endpoint_errors_are_classified(server, backend):
    server.reply_next("/pause_generation", Raw(500, error_body(500, "scheduler is gone")))
    with pytest.raises(BackendError) as info:
        await backend.pause()
    assert info.value.error_class is ErrorClass.SERVER
    assert "POST /pause_generation" in info.value.message and "scheduler is gone" in info.value.message

    server.reply_next("/continue_generation", Raw(400, error_body(400, "Field required")))
    with pytest.raises(BackendError) as info:
        await backend.resume()
    assert info.value.error_class is ErrorClass.CLIENT
    assert "POST /continue_generation" in info.value.message


# -- abort and pause -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_abort_one_held_request_returns_its_partial_tokens(server, backend):
    server.script(Generate(token_ids=[11, 12, 13], hold=True), Generate(token_ids=[21], hold=True))
    results = {}
    finished = {"traj-a": anyio.Event(), "traj-b": anyio.Event()}

    async def run(rid: str) -> None:
        results[rid] = await backend.generate([1, 2], PARAMS, rid=rid)
        finished[rid].set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "traj-a")
            await wait_held(server, 1)
            tg.start_soon(run, "traj-b")
            await wait_held(server, 2)

            await backend.abort("traj-a")
            await finished["traj-a"].wait()
            assert "traj-b" not in results
            assert server.num_held == 1

            await backend.abort("traj-b")

    a, b = results["traj-a"], results["traj-b"]
    assert (a.finish_reason, a.token_ids, len(a.logprobs)) == ("abort", [11, 12, 13], 3)
    assert (b.finish_reason, b.token_ids) == ("abort", [21])
    prefix = backend.rid_prefix
    assert [r.body for r in server.requests_to("/abort_request")] == [
        {"rid": f"{prefix}0-traj-a"}, {"rid": f"{prefix}1-traj-b"},
    ]  # fmt: skip


@pytest.mark.anyio
async def test_abort_of_a_rid_leaves_a_rid_it_is_a_prefix_of(server, backend):
    """SGLang aborts every rid that starts with a known one: the ids sent are never prefixes of each other."""
    server.script(Generate(hold=True), Generate(hold=True))
    results = {}
    first_done = anyio.Event()

    async def run(rid: str) -> None:
        results[rid] = await backend.generate([1], PARAMS, rid=rid)
        if rid == "traj-1":
            first_done.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "traj-1")
            await wait_held(server, 1)
            tg.start_soon(run, "traj-10")
            await wait_held(server, 2)
            await backend.abort("traj-1")
            await first_done.wait()
            assert server.held_rids == [f"{backend.rid_prefix}1-traj-10"]
            await backend.abort("traj-10")
    assert results["traj-10"].finish_reason == "abort"


@pytest.mark.anyio
async def test_abort_with_nothing_in_flight_sends_nothing(server, backend):
    await backend.generate([1], PARAMS, rid="done")
    await backend.abort("done")
    await backend.abort()
    assert server.requests_to("/abort_request") == []


@pytest.mark.anyio
async def test_abort_all_aborts_every_held_request(server, backend):
    server.script(*[Generate(token_ids=[i, i + 1], hold=True) for i in range(0, 30, 10)])
    results = []

    async def run(index: int) -> None:
        results.append(await backend.generate([index], PARAMS, rid=f"traj-{index}"))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for index in range(3):
                tg.start_soon(run, index)
            await wait_held(server, 3)
            await backend.abort()

    assert [r.finish_reason for r in results] == ["abort"] * 3
    assert sorted(r.token_ids for r in results) == [[0, 1], [10, 11], [20, 21]]
    aborted = sorted(r.body["rid"] for r in server.requests_to("/abort_request"))
    assert aborted == [f"{backend.rid_prefix}{n}-traj-{i}" for n, i in enumerate(range(3))]


@pytest.mark.anyio
async def test_abort_all_leaves_other_clients_requests_alone(server, backend):
    server.script(Generate(hold=True), Generate(token_ids=[7], hold=True))
    ours, ours_done = [], anyio.Event()
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True, "rid": "other-1"}

    async def foreign() -> None:
        async with httpx2.AsyncClient(trust_env=False) as client:
            theirs.append((await client.post(f"{server.url}/generate", json=body)).json())

    async def run() -> None:
        ours.append(await backend.generate([1], PARAMS))
        ours_done.set()

    theirs = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(foreign)
            await wait_held(server, 1)
            tg.start_soon(run)
            await wait_held(server, 2)
            await backend.abort()
            await ours_done.wait()
            assert server.held_rids == ["other-1"]  # the other client's request is still running
            server.release_all()
    assert ours[0].finish_reason == "abort"
    assert [r.body for r in server.requests_to("/abort_request")] == [{"rid": f"{backend.rid_prefix}0-"}]
    assert not any(r.body.get("abort_all") for r in server.requests_to("/abort_request"))


@pytest.mark.anyio
async def test_pause_and_resume_send_sglang_bodies(server, backend):
    await backend.pause()
    assert server.paused_mode == "in_place"
    await backend.pause("retract")
    assert server.paused_mode == "retract"
    await backend.resume()
    assert server.paused_mode is None

    assert sent(server) == [
        ("POST", "/pause_generation", {"mode": "in_place"}),
        ("POST", "/pause_generation", {"mode": "retract"}),
        ("POST", "/continue_generation", {}),
    ]
    with pytest.raises(ValueError, match="pause mode"):
        await backend.pause("drain")
    assert len(sent(server)) == 3


@pytest.mark.anyio
async def test_pause_in_abort_mode_returns_held_requests_as_aborted(server, backend):
    server.script(Generate(token_ids=[5, 6], hold=True))
    results = []

    async def run() -> None:
        results.append(await backend.generate([1], PARAMS, rid="r"))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await wait_held(server, 1)
            await backend.pause(mode="abort")

    assert (results[0].finish_reason, results[0].token_ids) == ("abort", [5, 6])


# -- weight version, health, weight updates ------------------------------------------------------


@pytest.mark.anyio
async def test_weight_version(server, backend):
    server.weight_version = "step-7"
    assert await backend.weight_version() == "step-7"
    server.weight_version = None
    assert await backend.weight_version() is None
    assert sent(server) == [("GET", "/model_info", None)] * 2

    server.reply_next("/model_info", Raw(200, {"version": 3}))
    with pytest.raises(BackendError) as info:
        await backend.weight_version()
    assert info.value.error_class is ErrorClass.MALFORMED
    assert "GET /model_info" in info.value.message and "'version': 3" in info.value.message


@pytest.mark.anyio
async def test_health(server, backend):
    assert await backend.health() is True
    server.healthy = False
    assert await backend.health() is False
    server.reply_next("/health", Raw(500, "boom", "text/plain"))
    assert await backend.health() is False
    assert sent(server) == [("GET", "/health", None)] * 3


@pytest.mark.anyio
async def test_health_of_unreachable_server_is_false():
    backend = SGLangBackend(closed_port_url())
    try:
        assert await backend.health() is False
    finally:
        await backend.aclose()


@pytest.mark.anyio
async def test_wait_until_healthy_returns_once_the_server_turns_healthy(server, backend):
    server.healthy = False
    done = anyio.Event()

    async def wait() -> None:
        await backend.wait_until_healthy(timeout=10, poll_interval=0.01)
        done.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            assert await anyio.to_thread.run_sync(server.health_checked.wait, 5)
            assert not done.is_set()  # it saw a 503 and keeps polling
            server.healthy = True
    assert done.is_set()
    assert len(server.requests_to("/health")) >= 2


@pytest.mark.anyio
async def test_wait_until_healthy_fails_at_the_deadline(server, backend):
    server.healthy = False
    with anyio.fail_after(10), pytest.raises(BackendError) as info:
        await backend.wait_until_healthy(timeout=0.3, poll_interval=0.02)
    assert info.value.error_class is ErrorClass.CONNECTION
    assert f"SGLang server at {server.url}" in info.value.message and "GET /health" in info.value.message
    assert "last answer HTTP 503" in info.value.message
    assert server.requests_to("/health")


@pytest.mark.anyio
async def test_wait_until_healthy_fails_for_unreachable_server():
    url = closed_port_url()
    backend = SGLangBackend(url)
    try:
        with anyio.fail_after(10), pytest.raises(BackendError) as info:
            await backend.wait_until_healthy(timeout=0.2, poll_interval=0.02)
    finally:
        await backend.aclose()
    assert info.value.error_class is ErrorClass.CONNECTION
    assert url in info.value.message and "never reachable" in info.value.message


@pytest.mark.anyio
async def test_update_weights_from_disk(server, backend):
    reply = await backend.update_weights_from_disk("/ckpt/iter_0000010", weight_version="10")
    assert reply["success"] is True
    assert await backend.weight_version() == "10"
    await backend.update_weights_from_disk("/ckpt/iter_0000020")

    bodies = [r.body for r in server.requests_to("/update_weights_from_disk")]
    assert bodies == [
        {"model_path": "/ckpt/iter_0000010", "weight_version": "10"},
        {"model_path": "/ckpt/iter_0000020"},
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("status", [400, 200])
async def test_update_weights_from_disk_refused_raises(server, backend, status):
    refusal = {"success": False, "message": "Failed to get weights iterator: /nope", "num_paused_requests": 0}
    server.reply_next("/update_weights_from_disk", Raw(status, refusal))
    with pytest.raises(BackendError) as info:
        await backend.update_weights_from_disk("/nope")
    assert info.value.error_class is ErrorClass.CLIENT
    assert "POST /update_weights_from_disk" in info.value.message
    assert "Failed to get weights iterator: /nope" in info.value.message


# -- the connection pool -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_many_concurrent_generates_share_one_bounded_pool(server):
    num_requests, max_connections = 64, 8
    server.script(*[Generate(delay_s=0.02) for _ in range(num_requests)])
    results = {}

    async def run(index: int) -> None:
        results[index] = await backend.generate([index, index + 1000], PARAMS, rid=f"r-{index}")

    async with SGLangBackend(server.url, max_connections=max_connections) as backend:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for index in range(num_requests):
                    tg.start_soon(run, index)

    assert sorted(results) == list(range(num_requests))
    assert all(results[i].token_ids == [i, i + 1000] for i in range(num_requests))  # each got its own reply
    ports = {r.client_port for r in server.requests_to("/generate")}
    assert 1 < len(ports) <= max_connections


@pytest.mark.anyio
async def test_closed_backend_refuses_requests(server):
    async with SGLangBackend(server.url) as backend:
        await backend.generate([1], PARAMS)
    with pytest.raises(RuntimeError):
        await backend.generate([1], PARAMS)


@pytest.mark.anyio
async def test_a_kept_alive_connection_the_server_closed_is_found_closed_and_not_reused():
    """The backend's transport tells an idle connection the server has closed by one poll of its socket
    (engine/backends/transport.py): the next request goes on a new connection, not the dead one."""
    from engine.backends.transport import http_transport

    connections, close_now, closed = 0, anyio.Event(), anyio.Event()
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

    async def answer_once_then_close(stream):
        nonlocal connections
        connections += 1
        async with stream:
            request = b""
            while b"\r\n\r\n" not in request:
                request += await stream.receive()
            await stream.send(reply)  # kept alive, as far as the client can tell, until the test says
            await close_now.wait()
        closed.set()  # on loopback its end of stream is on the client's socket once close() returns

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    transport = http_transport(httpx2.Limits(max_connections=4), tls=False)
    with anyio.fail_after(10):
        async with listener, anyio.create_task_group() as tg, httpx2.AsyncClient(transport=transport) as client:
            tg.start_soon(listener.serve, answer_once_then_close)
            assert (await client.get(f"http://127.0.0.1:{port}/health")).json() == {}
            [pooled] = transport._pool.connections
            assert type(pooled._connection._network_stream).__name__ == "_PollingStream"
            close_now.set()
            await closed.wait()
            assert (await client.get(f"http://127.0.0.1:{port}/health")).json() == {}
            tg.cancel_scope.cancel()
    assert connections == 2
