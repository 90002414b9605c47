"""Image payloads and SGLang request bodies: each image encoded (PNG) and serialised (JSON) once however many
turns carry it, large bodies built in a worker thread, and the bytes on the wire what they were."""

from __future__ import annotations

import array
import json
import threading

import anyio
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image, ImageDraw

import engine.backends.sglang as sglang_module
import engine.backends.sglang_format as sglang_format
import engine.multimodal as multimodal
from engine.backends.base import SamplingParams
from engine.backends.sglang import SGLangBackend
from engine.backends.sglang_format import (
    THREAD_MIN_BYTES,
    JSONStrings,
    body_size,
    collapse_image_pads,
    generate_body,
)
from engine.encoding import ChatEncoder
from engine.multimodal import ImagePayloads
from engine.trajectory import Trajectory, Turn
from tests.sglang_double import Generate, SGLangDouble

PAD = 151655


def reference_collapse(ids: list[int], pad: int) -> list[int]:
    """Every run of `pad` cut to one token, the obvious way."""
    return [t for i, t in enumerate(ids) if t != pad or i == 0 or ids[i - 1] != pad]


def httpx_json(body: dict) -> bytes:
    """What httpx2's `json=` sends (2.16: compact separators, UTF-8, no NaN), as httpx 0.28's did."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def counting(monkeypatch, module, name: str) -> list:
    """Replace module.name with a wrapper that records each call's first argument."""
    calls, original = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(args[0] if args else None)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def picture(seed: int, size=(64, 48)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


@pytest.fixture
def server():
    with SGLangDouble() as double:
        yield double


# -- the body ----------------------------------------------------------------------------------------


@given(st.lists(st.sampled_from([1, 2, PAD, 151652, 151653]), max_size=60))
def test_collapse_image_pads_cuts_each_run_to_one(ids):
    assert collapse_image_pads(ids, PAD).tolist() == reference_collapse(ids, PAD)


def test_body_bytes_are_what_httpx_json_sent():
    params = SamplingParams(
        max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(151645,), stop=("</tool>", "é")
    ).to_sglang()
    ids = [1, 2, 3, 151645]
    images = ["data:image/png;base64,iVBORw0KGgo=", 'a "quoted" \\ payload\n']
    for image_data in (None, [], images):
        expected = {"input_ids": ids, "sampling_params": params, "return_logprob": True, "rid": "turnstile-ab-0-x"}
        if image_data is not None:
            expected["image_data"] = image_data
        for given_ids in (ids, tuple(ids), array.array("i", ids), np.array(ids, dtype=np.int64)):
            body, sent = generate_body(given_ids, params, "turnstile-ab-0-x", image_data, strings=JSONStrings())
            assert (body, sent) == (httpx_json(expected), len(ids)), (image_data, type(given_ids).__name__)


def test_body_collapses_pads_only_with_images():
    ids = [1, 151652, PAD, PAD, PAD, 151653, 2]
    with_images, sent = generate_body(ids, {}, "r", ["a"], image_token_id=PAD)
    assert json.loads(with_images)["input_ids"] == [1, 151652, PAD, 151653, 2] and sent == 5
    without, sent = generate_body(ids, {}, "r", None, image_token_id=PAD)
    assert json.loads(without)["input_ids"] == ids and sent == 7


def test_json_strings_serialise_each_payload_once_and_stay_bounded(monkeypatch):
    calls = counting(monkeypatch, sglang_format, "json_string")
    strings = JSONStrings(max_bytes=2 * 1003)  # two of them, quoted
    first, second, third = ("x" * 1000 + str(i) for i in range(3))
    assert strings(first) == strings(first) == f'"{first}"'.encode()
    strings(second)
    assert calls == [first, second]
    strings(third)  # over the bound: the least recently used (first) goes
    assert len(strings) == 2
    strings(second), strings(third)
    assert calls == [first, second, third]
    strings(first)
    assert calls == [first, second, third, first]


# -- a trajectory's images -------------------------------------------------------------------------------


def image_message(image: Image.Image, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}


@pytest.mark.anyio
async def test_three_turn_trajectory_encodes_and_serialises_each_image_once(processor, server, monkeypatch):
    """Turn k sends all k images so far, yet each is PNG-encoded once and JSON-serialised once; the drift check
    that re-renders the conversation encodes none."""
    png = counting(monkeypatch, multimodal, "image_payload")
    serialised = counting(monkeypatch, sglang_format, "json_string")
    encoder = ChatEncoder(processor.tokenizer, processor=processor, payloads=ImagePayloads())
    images = [picture(i) for i in range(3)]
    trajectory = Trajectory(prompt=[image_message(images[0], "What is drawn?")])
    prompt = await encoder.aencode_prompt(trajectory.prompt)
    trajectory.set_prompt(prompt.token_ids)
    trajectory.image_data.extend(prompt.image_data)
    params = SamplingParams(max_new_tokens=8, stop_token_ids=encoder.stop_token_ids)
    answer = processor.tokenizer("A square.", add_special_tokens=False)["input_ids"] + [encoder.end_of_turn_id]
    async with SGLangBackend(server.url, image_token_id=encoder.image_token_id, json_strings=JSONStrings()) as backend:
        for turn in range(3):
            server.script(Generate(token_ids=answer, prompt_tokens=len(trajectory.tokens)))
            result = await backend.generate(trajectory.tokens.tolist(), params, trajectory.image_data)
            start = trajectory.response_length
            trajectory.append_generation(result.token_ids, result.logprobs)
            trajectory.turns.append(Turn(index=turn, start=start, num_generated=len(result.token_ids)))
            if turn < 2:
                message = image_message(images[turn + 1], f"Look again ({turn}).")
                observation = await encoder.aencode_observation(message)
                trajectory.append_observation(observation.token_ids)
                trajectory.image_data.extend(observation.image_data)
                trajectory.turns[-1].num_observation = len(observation.token_ids)
                trajectory.turns[-1].observation = message
    bodies = [r.body for r in server.requests_to("/generate")]
    assert [len(b["image_data"]) for b in bodies] == [1, 2, 3]
    assert all(b["image_data"] == trajectory.image_data[: len(b["image_data"])] for b in bodies)
    assert len(png) == 3
    assert serialised == trajectory.image_data  # each payload once, in order
    assert (await encoder.adrift_check(trajectory)).exact
    assert len(png) == 3


def test_equal_images_share_one_payload_and_a_changed_image_is_encoded_again(monkeypatch):
    """Keyed by pixels: a group's members (equal images, distinct objects) encode once; an image drawn on
    after its first use is a new image."""
    png = counting(monkeypatch, multimodal, "image_payload")
    payloads = ImagePayloads()
    image = picture(7)
    assert payloads(image) is payloads(image.copy()) is payloads(picture(7))
    assert len(png) == 1
    ImageDraw.Draw(image).rectangle((0, 0, 10, 10), fill="white")
    changed = payloads(image)
    assert len(png) == 2 and changed != payloads(picture(7))
    assert multimodal.load_image(changed).getpixel((5, 5)) == (255, 255, 255)


def test_image_payloads_are_bounded():
    payloads = ImagePayloads(max_bytes=len(multimodal.image_payload(picture(0))) * 2 + 10)
    for seed in (0, 1, 2):
        payloads(picture(seed))
    assert len(payloads) == 2 and payloads.encodes == 3
    payloads(picture(2)), payloads(picture(1))
    assert payloads.encodes == 3
    payloads(picture(0))  # the least recently used one went out
    assert payloads.encodes == 4


def test_a_thread_asking_for_an_image_being_encoded_waits_for_it(monkeypatch):
    entered, release, waiting = threading.Event(), threading.Event(), threading.Event()
    calls = []

    def slow_payload(image):
        calls.append(image)
        entered.set()
        assert release.wait(10)
        return "data:image/png;base64,AAAA"

    class SpyEvent(threading.Event):
        def wait(self, timeout=None):
            waiting.set()
            return super().wait(timeout)

    monkeypatch.setattr(multimodal, "image_payload", slow_payload)
    monkeypatch.setattr(multimodal.threading, "Event", SpyEvent)
    payloads, results = ImagePayloads(), []
    first = threading.Thread(target=lambda: results.append(payloads(picture(3))))
    second = threading.Thread(target=lambda: results.append(payloads(picture(3))))
    first.start()
    assert entered.wait(10)
    second.start()
    assert waiting.wait(10)  # the second thread waits on the first one's encode
    release.set()
    first.join(10), second.join(10)
    assert len(calls) == 1 and results == ["data:image/png;base64,AAAA"] * 2


# -- off the loop ------------------------------------------------------------------------------------


def large_images() -> list[str]:
    """Payload-like strings adding up to past THREAD_MIN_BYTES."""
    return [f"data:image/png;base64,{i}" + "A" * (THREAD_MIN_BYTES // 2) for i in range(2)]


def build_threads(monkeypatch) -> list[int]:
    """Record the thread each /generate body is built in."""
    threads, original = [], sglang_module.generate_body

    def spy(*args, **kwargs):
        threads.append(threading.get_ident())
        return original(*args, **kwargs)

    monkeypatch.setattr(sglang_module, "generate_body", spy)
    return threads


@pytest.mark.anyio
async def test_token_buffers_are_sent_as_the_same_ids(server):
    prompt = [1, 151652, PAD, PAD, 151653, 2]
    async with SGLangBackend(server.url, image_token_id=PAD) as backend:
        for ids in (prompt, array.array("i", prompt), np.array(prompt)):
            server.script(Generate(token_ids=[7], prompt_tokens=len(prompt)))
            await backend.generate(ids, SamplingParams(max_new_tokens=1), ["data:image/png;base64,AAAA"])
    sent = [r.body["input_ids"] for r in server.requests_to("/generate")]
    assert sent == [[1, 151652, PAD, 151653, 2]] * 3


@pytest.mark.anyio
async def test_large_bodies_are_built_in_a_worker_thread_small_ones_inline(server, monkeypatch):
    threads = build_threads(monkeypatch)
    loop_thread = threading.get_ident()
    images = large_images()
    assert body_size([1, 2], images) >= THREAD_MIN_BYTES > body_size([1, 2], ["data:image/png;base64,AAAA"])
    async with SGLangBackend(server.url) as backend:
        await backend.generate([1, 2], SamplingParams(max_new_tokens=2), images, rid="big")
        await backend.generate([1, 2], SamplingParams(max_new_tokens=2), ["data:image/png;base64,AAAA"], rid="small")
    assert threads[0] != loop_thread and threads[1] == loop_thread
    big, small = server.requests_to("/generate")
    assert big.body["image_data"] == images and big.body["rid"].endswith("-big")
    assert big.headers["content-type"] == small.headers["content-type"] == "application/json"


@pytest.mark.anyio
async def test_a_request_aborted_while_its_body_is_built_is_never_sent(server, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    original = sglang_module.generate_body

    def slow_build(*args, **kwargs):
        entered.set()
        assert release.wait(10)
        return original(*args, **kwargs)

    monkeypatch.setattr(sglang_module, "generate_body", slow_build)
    async with SGLangBackend(server.url) as backend:
        results = []

        async def generate():
            results.append(await backend.generate([1], SamplingParams(max_new_tokens=2), large_images(), rid="t"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(generate)
            assert await anyio.to_thread.run_sync(entered.wait, 10)
            await backend.abort("t")
            release.set()
    [result] = results
    assert (result.finish_reason, result.token_ids) == ("abort", [])
    assert server.requests_to("/generate") == [] and server.requests_to("/abort_request") == []


@pytest.mark.anyio
async def test_the_payloads_benchmark_runs_a_trajectory(processor):
    from benchmarks.micro.payloads import run_trajectory

    encoder = ChatEncoder(processor.tokenizer, processor=processor, payloads=ImagePayloads())
    for mode in ("sync", "async"):
        figures = await run_trajectory(encoder, mode, 2, 32, seed=mode == "async", lag=True)
        assert figures["final_images"] == 3 and figures["loop_cpu_ms"] > 0 and figures["lag_max_ms"] >= 0
