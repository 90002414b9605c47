"""LocalBackend on the tiny random-weight models: batching, exact log-probs, stops, abort, pause, weights,
failures and images. References come from transformers itself (`generate`, a full forward pass)."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import anyio
import pytest
import torch
from PIL import Image

from engine.backends.base import STREAM_BROKEN, Backend, GenerateResult, SamplingParams
from engine.backends.local import LocalBackend
from engine.backends.sampling import sample
from engine.errors import BackendError, ErrorClass
from engine.models import load_model
from engine.multimodal import image_payload

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def prompt(length: int, seed: int = 0) -> list[int]:
    """Ordinary (non-special) token ids."""
    return torch.randint(0, 151_000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def text_model():
    return load_model("tiny-qwen2")


@pytest.fixture(scope="module")
def vl_model():
    return load_model("tiny-qwen2.5-vl")


@pytest.fixture
async def backend(text_model, tokenizer):
    async with LocalBackend(text_model, tokenizer) as local:
        yield local


async def generate_all(backend: LocalBackend, requests: list[tuple]) -> list[GenerateResult]:
    """Submit every (input_ids, params[, image_data]) at once; results in request order."""
    results: list[GenerateResult | None] = [None] * len(requests)

    async def one(i: int) -> None:
        results[i] = await backend.generate(*requests[i])

    async with anyio.create_task_group() as task_group:
        for i in range(len(requests)):
            task_group.start_soon(one, i)
    return results


def reference_greedy(model, input_ids: list[int], n: int, **inputs) -> list[int]:
    ids = torch.tensor([input_ids])
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
        eos_token_id=None, pad_token_id=0, **inputs,
    )  # fmt: skip
    return out[0, len(input_ids) :].tolist()


def reference_logprobs(model, input_ids: list[int], tokens: list[int], temperature: float, **inputs) -> torch.Tensor:
    """log_softmax(logits / temperature) of a full forward pass over prompt + output, at each output token."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([input_ids + tokens]), **inputs).logits[0, len(input_ids) - 1 : -1]
    return torch.log_softmax(logits / (temperature or 1.0), -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


# -- outputs -----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_greedy_batch_matches_transformers_generate(backend, text_model):
    prompts = [prompt(n, seed=n) for n in (3, 11, 29, 64)]
    results = await generate_all(backend, [(p, GREEDY) for p in prompts])
    for p, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_greedy(text_model, p, 12)
        assert result.finish_reason == "length"
    assert backend.statistics().num_batches == 1  # the four prompts ran as one left-padded batch
    assert isinstance(backend, Backend)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "params",
    [
        greedy(10),
        SamplingParams(max_new_tokens=10, temperature=0.7, ignore_eos=True),
        SamplingParams(max_new_tokens=10, temperature=1.3, top_k=50, top_p=0.9, ignore_eos=True),
    ],
    ids=["greedy", "t0.7", "t1.3-topk-topp"],
)
async def test_logprobs_equal_a_full_forward_pass(backend, text_model, params):
    prompts = [prompt(n, seed=100 + n) for n in (5, 23, 40)]
    results = await generate_all(backend, [(p, params) for p in prompts])
    for p, result in zip(prompts, results, strict=True):
        assert len(result.logprobs) == len(result.token_ids) == 10
        expected = reference_logprobs(text_model, p, result.token_ids, params.temperature)
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.anyio
async def test_top_k_one_is_greedy(backend):
    p = prompt(17, seed=3)
    (sampled, plain) = await generate_all(
        backend, [(p, SamplingParams(max_new_tokens=8, temperature=1.0, top_k=1, ignore_eos=True)), (p, greedy(8))]
    )
    assert sampled.token_ids == plain.token_ids


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_sampling_draws_from_the_tempered_distribution(temperature):
    torch.manual_seed(0)
    rows, vocab = 6000, 300  # 300 is no multiple of the sampler's block: the padding is exercised too
    logits = torch.full((vocab,), -20.0)
    logits[[3, 150, 299]] = torch.tensor([1.0, 2.0, 0.5])
    expected = torch.softmax(logits / temperature, -1)
    plain = SamplingParams(max_new_tokens=1, temperature=temperature)
    tokens, logprobs = sample(logits.repeat(rows, 1), [plain] * rows)
    frequencies = torch.bincount(tokens, minlength=vocab).double() / rows
    torch.testing.assert_close(frequencies, expected.double(), atol=0.02, rtol=0)
    torch.testing.assert_close(logprobs, expected.log()[tokens], atol=1e-5, rtol=0)
    top_k, top_p = dataclasses.replace(plain, top_k=2), dataclasses.replace(plain, top_p=0.6)  # token 150 has > 0.6
    for narrowed, allowed in ((top_k, {3, 150}), (top_p, {150})):
        tokens, logprobs = sample(logits.repeat(rows, 1), [narrowed] * rows)
        assert set(tokens.tolist()) == allowed
        torch.testing.assert_close(logprobs, expected.log()[tokens], atol=1e-5, rtol=0)  # of the full distribution


@pytest.mark.anyio
async def test_stop_token_ends_with_stop_and_is_included(backend, tokenizer):
    p = prompt(9, seed=4)
    free = await backend.generate(p, greedy(6))
    stop = free.token_ids[2]
    first = free.token_ids.index(stop)
    result = await backend.generate(p, SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=(stop,)))
    assert result.finish_reason == "stop"
    assert result.token_ids == free.token_ids[: first + 1] and result.token_ids[-1] == stop
    assert len(result.logprobs) == first + 1
    assert result.text == tokenizer.decode(free.token_ids[:first])


@pytest.mark.anyio
async def test_tokenizer_eos_stops_unless_ignore_eos(text_model, tokenizer):
    p = prompt(9, seed=5)
    async with LocalBackend(text_model, tokenizer) as local:
        first = (await local.generate(p, greedy(1))).token_ids[0]
    eos_tokenizer = SimpleNamespace(eos_token_id=first, decode=tokenizer.decode)
    async with LocalBackend(text_model, eos_tokenizer) as local:
        stopped = await local.generate(p, SamplingParams(max_new_tokens=5, temperature=0))
        ignored = await local.generate(p, greedy(5))
    assert (stopped.finish_reason, stopped.token_ids, stopped.text) == ("stop", [first], "")
    assert (ignored.finish_reason, len(ignored.token_ids)) == ("length", 5)


@pytest.mark.anyio
async def test_stop_string_ends_with_stop_and_is_cut_from_text(backend, tokenizer):
    p = prompt(9, seed=6)
    free = await backend.generate(p, greedy(4))
    stop = tokenizer.decode(free.token_ids[1:3])
    result = await backend.generate(p, SamplingParams(max_new_tokens=4, temperature=0, stop=(stop,)))
    assert result.finish_reason == "stop" and len(result.token_ids) <= 3
    assert stop not in result.text


@pytest.mark.anyio
async def test_max_new_tokens_gives_length(backend, tokenizer):
    p = prompt(13, seed=7)
    result = await backend.generate(p, greedy(5))
    assert result.finish_reason == "length" and len(result.token_ids) == 5 == len(result.logprobs)
    assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert (result.prompt_tokens, result.weight_version) == (13, "0")
    assert all(lp <= 0 for lp in result.logprobs)


# -- batching ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_concurrent_requests_are_batched(backend):
    results = await generate_all(backend, [(prompt(8 + i, seed=i), greedy(6)) for i in range(16)])
    stats = backend.statistics()
    assert all(r.finish_reason == "length" for r in results)
    assert stats.num_requests == stats.num_finished == 16
    assert stats.num_batches < 16 and stats.largest_batch > 1
    assert (stats.num_waiting, stats.num_running) == (0, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.num_steps = 0  # type: ignore[misc]


@pytest.mark.anyio
async def test_early_row_resolves_before_the_long_row_finishes(backend):
    long_done = anyio.Event()
    order: list[str] = []

    async def long() -> None:
        await backend.generate(prompt(20, seed=8), greedy(60))
        order.append("long")
        long_done.set()

    async def short() -> None:
        await backend.generate(prompt(20, seed=9), greedy(2))
        order.append("short" if not long_done.is_set() else "short-late")

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(long)
        task_group.start_soon(short)
    assert order == ["short", "long"]
    assert backend.statistics().num_batches == 1  # same batch


@pytest.mark.anyio
async def test_late_request_joins_the_running_batch(backend, text_model):
    late_prompt = prompt(31, seed=10)
    results: dict[str, GenerateResult] = {}
    order: list[str] = []

    async def run(name: str, input_ids: list[int], n: int) -> None:
        results[name] = await backend.generate(input_ids, greedy(n))
        order.append(name)

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(run, "long", prompt(7, seed=11), 80)
        await run("trigger", prompt(7, seed=12), 2)  # the long request is decoding now
        await run("late", late_prompt, 6)
    assert order == ["trigger", "late", "long"]  # "late" did not wait for the long batch to drain
    assert backend.statistics().num_batches == 2
    assert results["late"].token_ids == reference_greedy(text_model, late_prompt, 6)
    assert results["long"].token_ids == reference_greedy(text_model, prompt(7, seed=11), 80)


# -- abort, cancellation, pause ---------------------------------------------------------------


@pytest.mark.anyio
async def test_abort_one_request_returns_its_partial_tokens(backend):
    results: dict[str, GenerateResult] = {}

    async def run(name: str, n: int) -> None:
        results[name] = await backend.generate(prompt(10, seed=len(name)), greedy(n), rid=name)

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(run, "long", 10_000)
        task_group.start_soon(run, "other", 20)
        await run("trigger", 3)
        await backend.abort("long")
    long, other = results["long"], results["other"]
    assert long.finish_reason == "abort" and 2 <= len(long.token_ids) < 10_000
    assert len(long.logprobs) == len(long.token_ids)
    assert (other.finish_reason, len(other.token_ids)) == ("length", 20)


@pytest.mark.anyio
async def test_abort_all(backend):
    results: list[GenerateResult] = []

    async def run(seed: int) -> None:
        results.append(await backend.generate(prompt(10, seed=seed), greedy(10_000)))

    async with anyio.create_task_group() as task_group:
        for seed in range(3):
            task_group.start_soon(run, seed)
        await backend.generate(prompt(10, seed=99), greedy(3))
        await backend.abort()
    assert [r.finish_reason for r in results] == ["abort"] * 3
    assert all(0 < len(r.token_ids) < 10_000 for r in results)
    assert backend.statistics().num_aborted == 3


@pytest.mark.anyio
async def test_caller_cancellation_drops_its_row(backend):
    async with anyio.create_task_group() as task_group:
        scope = anyio.CancelScope()

        async def cancelled() -> None:
            with scope:
                await backend.generate(prompt(10, seed=13), greedy(10_000))

        task_group.start_soon(cancelled)
        await backend.generate(prompt(10, seed=14), greedy(3))
        scope.cancel()
    assert backend.statistics().num_aborted == 1
    result = await backend.generate(prompt(10, seed=15), greedy(4))
    assert result.finish_reason == "length"
    await anyio.wait_all_tasks_blocked()
    stats = backend.statistics()
    await anyio.wait_all_tasks_blocked()
    assert backend.statistics().num_steps == stats.num_steps and stats.num_running == 0  # idle


@pytest.mark.anyio
async def test_pause_holds_requests_in_place_until_resume(backend, text_model):
    long_prompt = prompt(12, seed=16)
    results: list[GenerateResult] = []

    async def long() -> None:
        results.append(await backend.generate(long_prompt, greedy(40)))

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(long)
        await backend.generate(prompt(12, seed=17), greedy(2))
        await backend.pause()
        steps = backend.statistics().num_steps
        await anyio.wait_all_tasks_blocked()
        assert backend.statistics().num_steps == steps and not results  # nothing moves while paused
        assert backend.statistics().num_running == 1
        await backend.resume()
    assert results[0].finish_reason == "length"
    assert results[0].token_ids == reference_greedy(text_model, long_prompt, 40)


@pytest.mark.anyio
async def test_update_weights_changes_version_and_output(tokenizer):
    model = load_model("tiny-qwen2")  # a private copy: its weights change
    p = prompt(15, seed=18)
    async with LocalBackend(model, tokenizer) as local:
        before = await local.generate(p, greedy(8))
        flipped = {"model.norm.weight": -model.model.norm.weight.detach().clone()}  # argmax becomes argmin
        await local.update_weights(flipped, "1")
        after = await local.generate(p, greedy(8))
        assert await local.weight_version() == "1"
        with pytest.raises(BackendError) as excinfo:
            await local.update_weights({"no.such.weight": torch.zeros(1)}, "2")
        assert excinfo.value.error_class is ErrorClass.CLIENT
    assert (before.weight_version, after.weight_version) == ("0", "1")
    assert after.token_ids != before.token_ids and after.logprobs != before.logprobs


async def _append(results: list, awaitable) -> None:
    results.append(await awaitable)


# -- failures and lifecycle --------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_failed_step_fails_its_batch_and_serving_goes_on(backend, text_model, monkeypatch):
    forward, calls = text_model.forward, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # prefill, decode, then this decode fails
            raise RuntimeError("boom")
        return forward(*args, **kwargs)

    monkeypatch.setattr(text_model, "forward", flaky)
    errors: list[BackendError] = []

    async def run(seed: int) -> None:
        with pytest.raises(BackendError) as excinfo:
            await backend.generate(prompt(6, seed=seed), greedy(10))
        errors.append(excinfo.value)

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(run, 1)
        task_group.start_soon(run, 2)
    assert [e.error_class for e in errors] == [ErrorClass.SERVER] * 2
    assert "RuntimeError: boom" in errors[0].message
    assert (await backend.generate(prompt(6, seed=3), greedy(4))).finish_reason == "length"
    assert backend.statistics().num_failed == 2


@pytest.mark.anyio
async def test_lifecycle(text_model, tokenizer):
    local = LocalBackend(text_model, tokenizer)
    assert not await local.health()
    results: list[GenerateResult] = []
    async with local:
        assert await local.health()
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(lambda: _append(results, local.generate(prompt(8), greedy(10_000))))
            await local.generate(prompt(8, seed=1), greedy(2))
            await local.aclose()  # in-flight requests come back aborted; the body goes on
        assert not await local.health()
    assert results[0].finish_reason == "abort" and results[0].token_ids
    with pytest.raises(BackendError) as excinfo:
        await local.generate([1, 2, 3], GREEDY)
    assert excinfo.value.error_class is ErrorClass.CONNECTION


@pytest.mark.anyio
async def test_bad_input_ids_are_client_errors(backend):
    for ids in ([], [-1], [10**7]):
        with pytest.raises(BackendError) as excinfo:
            await backend.generate(ids, GREEDY)
        assert excinfo.value.error_class is ErrorClass.CLIENT


# -- images ------------------------------------------------------------------------------------


def image_prompt(processor, images: list[Image.Image]) -> dict:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "What is in the picture?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return processor(text=[text], images=images, return_tensors="pt")


IMAGES = [Image.new("RGB", (56, 84), (200, 30, 40)), Image.new("RGB", (112, 56), (10, 200, 90))]


@pytest.mark.anyio
async def test_vl_prompt_with_images_generates_like_transformers(vl_model, processor):
    encoded = image_prompt(processor, IMAGES)
    ids = encoded["input_ids"][0].tolist()
    text_only = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Just text."}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    params = SamplingParams(max_new_tokens=6, temperature=0.8, ignore_eos=True)
    async with LocalBackend(vl_model, processor.tokenizer, processor=processor) as local:
        image_result, text_result, greedy_result = await generate_all(
            local,
            [(ids, params, [image_payload(im) for im in IMAGES]), (text_only, greedy(6)),
             (ids, greedy(6), [image_payload(im) for im in IMAGES])],
        )  # fmt: skip
    vision = {k: encoded[k] for k in ("pixel_values", "image_grid_thw")}
    mm_types = torch.tensor([[int(t == vl_model.config.image_token_id) for t in ids + image_result.token_ids]])
    expected = reference_logprobs(vl_model, ids, image_result.token_ids, 0.8, mm_token_type_ids=mm_types, **vision)
    torch.testing.assert_close(torch.tensor(image_result.logprobs), expected, atol=1e-4, rtol=0)
    reference = reference_greedy(vl_model, ids, 6, mm_token_type_ids=encoded["mm_token_type_ids"], **vision)
    assert greedy_result.token_ids == reference
    assert text_result.token_ids == reference_greedy(vl_model, text_only, 6)


@pytest.mark.anyio
async def test_vl_image_count_must_match_the_image_pads(vl_model, processor):
    ids = image_prompt(processor, IMAGES[:1])["input_ids"][0].tolist()
    async with LocalBackend(vl_model, processor.tokenizer, processor=processor) as local:
        for image_data in ([], [image_payload(im) for im in IMAGES]):
            with pytest.raises(BackendError) as excinfo:
                await local.generate(ids, GREEDY, image_data)
            assert excinfo.value.error_class is ErrorClass.CLIENT
            assert "image count mismatch" in excinfo.value.message
        with pytest.raises(BackendError) as excinfo:
            await local.generate(ids, GREEDY, ["data:image/png;base64,bm90IGFuIGltYWdl"])
        assert excinfo.value.error_class is ErrorClass.CLIENT


@pytest.mark.anyio
async def test_images_sent_to_a_text_model_are_client_errors(backend):
    with pytest.raises(BackendError) as excinfo:
        await backend.generate(prompt(5), GREEDY, [image_payload(IMAGES[0])])
    assert excinfo.value.error_class is ErrorClass.CLIENT
    assert "text-only" in excinfo.value.message


@pytest.mark.anyio
async def test_images_are_processed_once_across_turns_and_model_steps_run_off_the_loop(
    vl_model, processor, monkeypatch
):
    """Each turn's request carries every image so far; each image is decoded and processed once, in a worker
    thread, and every model step runs in one too."""
    loop_thread, processed, steps = threading.get_ident(), [], []

    def image_processor(*, images, **kwargs):
        processed.append((threading.get_ident(), len(images)))
        return processor.image_processor(images=images, **kwargs)

    forward = vl_model.forward
    monkeypatch.setattr(vl_model, "forward", lambda *a, **kw: steps.append(threading.get_ident()) or forward(*a, **kw))
    images = [*IMAGES, Image.new("RGB", (84, 84), (20, 20, 220))]
    payloads = [image_payload(image) for image in images]
    spy = SimpleNamespace(image_processor=image_processor)
    async with LocalBackend(vl_model, processor.tokenizer, processor=spy) as local:
        for turn in (1, 2, 3):
            ids = image_prompt(processor, images[:turn])["input_ids"][0].tolist()
            result = await local.generate(ids, greedy(2), payloads[:turn])
            assert len(result.token_ids) == 2
    assert processed and all(thread != loop_thread for thread, _ in processed)
    assert [count for _, count in processed] == [1, 1, 1]  # one image each: the first, the second, the third
    assert steps and loop_thread not in steps


# -- streaming ------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_each_request_streams_its_tokens_as_each_step_makes_them(backend):
    """Two requests batched together: each listener gets its own tokens, one per step, the first while the
    backend has made one token of that request (of many to come), and all before the result."""
    calls: dict[int, list[list[int]]] = {0: [], 1: []}
    made_at_first_call: dict[int, int] = {}

    def listener(i: int):
        def on_tokens(token_ids: list[int]) -> None:
            if not calls[i]:
                made_at_first_call[i] = backend.statistics().num_generated_tokens
            calls[i].append(token_ids)

        return on_tokens

    results: list[GenerateResult | None] = [None, None]

    async def one(i: int) -> None:
        results[i] = await backend.generate(prompt(8, seed=i), greedy(12), on_tokens=listener(i))

    async with anyio.create_task_group() as task_group:
        for i in range(2):
            task_group.start_soon(one, i)
    for i in range(2):
        assert [t for call in calls[i] for t in call] == results[i].token_ids and len(results[i].token_ids) == 12
        assert all(len(call) == 1 for call in calls[i])
        assert made_at_first_call[i] <= 2  # the first step's tokens: the two requests' first ones
    assert LocalBackend.streams


@pytest.mark.anyio
async def test_an_aborted_stream_ends_with_the_tokens_its_listener_got(backend):
    got: list[int] = []
    third = anyio.Event()

    def on_tokens(token_ids: list[int]) -> None:
        got.extend(token_ids)
        if len(got) >= 3:
            third.set()

    results = []

    async def run() -> None:
        results.append(await backend.generate(prompt(10, seed=3), greedy(10_000), rid="long", on_tokens=on_tokens))

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(run)
        await third.wait()
        await backend.abort("long")
    assert results[0].finish_reason == "abort" and got == results[0].token_ids and len(got) < 10_000


@pytest.mark.anyio
async def test_a_listener_that_raises_is_dropped_and_serving_goes_on(backend, caplog):
    calls = []

    def failing(token_ids: list[int]) -> None:
        calls.append(token_ids)
        raise RuntimeError("gone")

    result = await backend.generate(prompt(6), greedy(5), on_tokens=failing)
    assert (result.finish_reason, len(result.token_ids), len(calls)) == ("length", 5, 1)
    assert (await backend.generate(prompt(6), greedy(3))).finish_reason == "length"
    assert "a token listener raised" in caplog.text


@pytest.mark.anyio
async def test_a_failed_step_ends_a_streamed_request_with_the_tokens_its_listener_got(backend, text_model, monkeypatch):
    forward, calls = text_model.forward, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # prefill, decode, then this decode fails: two tokens made and handed over
            raise RuntimeError("boom")
        return forward(*args, **kwargs)

    monkeypatch.setattr(text_model, "forward", flaky)
    got: list[int] = []
    result = await backend.generate(prompt(6, seed=1), greedy(10), on_tokens=got.extend)
    assert (result.finish_reason, result.token_ids, got) == ("abort", got, result.token_ids) and len(got) == 2
    assert "RuntimeError: boom" in result.meta[STREAM_BROKEN]
    assert backend.statistics().num_failed == 1 and backend.statistics().num_aborted == 0
