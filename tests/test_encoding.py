"""Delta encoding against the real Qwen vocabulary and the official chat templates.

Trajectories are built by the engine's own turn loop (`run_trajectory`) over a scripted backend
that replies with canonical tokens of given answers, then compared with a full re-render.
"""

from __future__ import annotations

import functools
import threading

import anyio
import pytest
import torch
from PIL import Image

from engine.backends.base import SamplingParams
from engine.encoding import INLINE_MAX_CHARS, ChatEncoder
from engine.envs.base import EnvRunner
from engine.errors import ObservationError
from engine.models import load_tokenizer, packaged_template
from engine.multimodal import ImagePayloads
from engine.scheduler.reference import run_trajectory
from engine.template_drift import SYSTEM, TOOLS  # the conversations check-template runs
from engine.trajectory import Status, StopReason, Trajectory
from engine.turn import TurnLimits
from tests.fakes import ScriptedBackend, ScriptedEnv

PROMPT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 17 + 25?"}]
ANSWERS = [f"I think the answer is {40 + i}." for i in range(5)]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]
APPEND_ONLY = ["Qwen2.5-7B-Instruct", "Llama-3.1-8B-Instruct", "Llama-3.2-3B-Instruct"]


@functools.cache
def template_tokenizer(templates_dir, name: str):
    """The Qwen vocabulary with the fixture template; Llama templates also get Llama's header tokens."""
    tokenizer = load_tokenizer("qwen2.5", chat_template=str(templates_dir / f"{name}.jinja"))
    if name.startswith("Llama"):
        tokenizer.add_special_tokens({"additional_special_tokens": LLAMA_SPECIALS})
        tokenizer.bos_token, tokenizer.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    return tokenizer


def template_kwargs(name: str) -> dict:
    return {"date_string": "26 Jul 2024"} if name.startswith("Llama") else {}


def build(encoder: ChatEncoder, answers, observations, prompt=PROMPT) -> Trajectory:
    """Run the turn loop: the model answers `answers` (canonical tokens + end-of-turn), the env `observations`."""
    replies = [encoder.tokenizer(a, add_special_tokens=False)["input_ids"] + [encoder.end_of_turn_id] for a in answers]
    trajectory = Trajectory(prompt=list(prompt))
    sampling = SamplingParams(max_new_tokens=1024, stop_token_ids=encoder.stop_token_ids)

    async def main():
        await run_trajectory(
            trajectory,
            backend=ScriptedBackend(replies),
            env=EnvRunner(ScriptedEnv(list(observations))),
            encoder=encoder,
            sampling=sampling,
            limits=TurnLimits(max_turns=len(answers), max_tokens=100_000),
        )

    anyio.run(main)
    return trajectory


def feedback(role: str, n: int = 5) -> list[dict]:
    return [{"role": role, "content": f"Feedback {i}: that is not right, try again."} for i in range(n)]


@pytest.mark.parametrize("name", APPEND_ONLY)
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("role", ["user", "tool"])
def test_append_only_templates_are_token_exact(templates_dir, name, tools, role):
    encoder = ChatEncoder(
        template_tokenizer(templates_dir, name), tools=tools, chat_template_kwargs=template_kwargs(name)
    )
    trajectory = build(encoder, ANSWERS, feedback(role))
    assert trajectory.status is Status.COMPLETED and len(trajectory.turns) == 5
    report = encoder.drift_check(trajectory)
    assert report.exact, report.describe()
    # Separators included: after the model's end-of-turn token the render continues with the observation.
    turns = [({"role": "assistant", "content": a}, o) for a, o in zip(ANSWERS, feedback(role), strict=True)]
    full = encoder.render(PROMPT + [m for turn in turns for m in turn][:-1], add_generation_prompt=False)
    ids = encoder.tokenizer(full, add_special_tokens=False)["input_ids"]
    assert trajectory.tokens.tolist() == ids[: len(trajectory.tokens)]
    assert len(ids) - len(trajectory.tokens) == report.trailing <= 1


def test_qwen_observation_starts_with_the_newline_after_im_end(tokenizer):
    """Qwen templates write "\\n" after the model's <|im_end|>; the observation must carry it."""
    encoder = ChatEncoder(tokenizer)
    ids = encoder.encode_observation({"role": "user", "content": "Try again."}).token_ids
    assert tokenizer.decode(ids[:2]) == "\n<|im_start|>"
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("name", ["Qwen2.5-7B-Instruct", "Llama-3.1-8B-Instruct"])
def test_system_prompt_and_tools_preamble_appear_once_in_five_turns(templates_dir, name):
    encoder = ChatEncoder(
        template_tokenizer(templates_dir, name), tools=TOOLS, chat_template_kwargs=template_kwargs(name)
    )
    trajectory = build(encoder, ANSWERS, feedback("user"))
    text = encoder.tokenizer.decode(trajectory.tokens.tolist())
    assert len(trajectory.turns) == 5
    assert text.count(SYSTEM) == 1
    assert text.count('"name": "calc_score"') == 1
    preamble = "# Tools" if name.startswith("Qwen") else "Given the following functions"
    assert text.count(preamble) == 1


def test_packaged_qwen_template_is_exact_without_fixtures(tokenizer):
    """The default tokenizer's own template (runs even where the fixtures are absent)."""
    encoder = ChatEncoder(tokenizer, tools=TOOLS)
    report = encoder.drift_check(build(encoder, ANSWERS, feedback("tool")))
    assert report.exact, report.describe()


def test_qwen3_think_stripping_is_reported_not_hidden(templates_dir):
    encoder = ChatEncoder(template_tokenizer(templates_dir, "Qwen3-0.6B"))
    answers = [f"<think>\nLet me add the numbers, attempt {i}.\n</think>\n\nThe answer is {40 + i}." for i in range(5)]
    trajectory = build(encoder, answers, feedback("user"))
    # The trajectory keeps what the model saw: every turn's reasoning is still in its tokens.
    assert encoder.tokenizer.decode(trajectory.tokens.tolist()).count("Let me add the numbers") == 5
    report = encoder.drift_check(trajectory)
    assert not report.exact
    assert (report.turn, report.part) == (0, "generated")
    assert "Let me add" in report.actual and "Let me add" not in report.expected
    assert "turn 0" in report.describe()


def test_qwen3_tool_observations_keep_reasoning_after_the_last_query(templates_dir):
    """Qwen3 keeps <think> for turns after the last real user query, so tool-role feedback drifts only
    at the final turn, where the template would add an empty think block the model did not see."""
    encoder = ChatEncoder(template_tokenizer(templates_dir, "Qwen3-0.6B"))
    answers = [f"<think>\nattempt {i}\n</think>\n\nThe answer is {40 + i}." for i in range(3)]
    report = encoder.drift_check(build(encoder, answers, feedback("tool", 3)))
    assert report.exact, report.describe()


def red_square(size: int) -> Image.Image:
    return Image.new("RGB", (size, size), (200, 30, 30))


def test_vlm_observation_images_get_as_many_pads_as_the_grid_says(processor):
    encoder = ChatEncoder(processor.tokenizer, processor=processor)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    merge = processor.image_processor.merge_size
    message = {
        "role": "user",
        "content": [
            {"type": "image", "image": red_square(56)},
            {"type": "image", "image": red_square(112)},
            {"type": "text", "text": "Look again."},
        ],
    }
    encoded = encoder.encode_observation(message)
    grid = encoded.train_inputs["image_grid_thw"]
    assert len(encoded.image_data) == 2 and all(d.startswith("data:image/png;base64,") for d in encoded.image_data)
    assert grid.shape == (2, 3)
    assert encoded.token_ids.count(pad) == int(grid.prod(dim=1).sum()) // merge**2
    assert encoded.train_inputs["pixel_values"].shape[0] == int(grid.prod(dim=1).sum())


def test_the_tokens_only_the_processor_writes_are_its_image_marks_and_placeholders(processor, tokenizer):
    """What a model turn may not sample (engine.turn.generate_turn cuts it there): every token an image
    adds to the encoding, and the video placeholder; none for a text-only encoder."""
    encoder = ChatEncoder(processor.tokenizer, processor=processor)
    names = {processor.tokenizer.convert_ids_to_tokens(t) for t in encoder.vision_token_ids}
    assert names == {"<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"}
    image = {"role": "user", "content": [{"type": "image", "image": red_square(56)}, {"type": "text", "text": "x"}]}
    added = set(encoder.encode_observation(image).token_ids) - set(
        encoder.encode_observation({"role": "user", "content": "x"}).token_ids
    )
    assert added == encoder.vision_token_ids - {processor.video_token_id}
    assert ChatEncoder(tokenizer).vision_token_ids == frozenset()


def test_vlm_trajectory_is_exact_with_images_in_prompt_and_observations(processor):
    encoder = ChatEncoder(processor.tokenizer, processor=processor)
    prompt = [
        {
            "role": "user",
            "content": [{"type": "image", "image": red_square(84)}, {"type": "text", "text": "What is drawn?"}],
        }
    ]
    observations = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": red_square(28 * (i + 2))},
                {"type": "text", "text": f"Look again ({i})."},
            ],
        }
        for i in range(4)
    ]
    trajectory = build(encoder, ANSWERS[:4], observations, prompt=prompt)
    assert encoder.drift_check(trajectory).exact
    assert len(trajectory.image_data) == 4  # the prompt's image and three observations' (the last step ends it)
    merged = trajectory.train_inputs.merge()
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert merged["image_grid_thw"].shape[0] == 4
    assert trajectory.tokens.tolist().count(pad) == int(merged["image_grid_thw"].prod(dim=1).sum()) // 4
    assert merged["pixel_values"].shape[0] == int(merged["image_grid_thw"].prod(dim=1).sum())


def test_turn_closed_without_end_of_turn_token_still_matches_the_template(tokenizer):
    """A turn cut by max_new_tokens is closed with the end-of-turn token (mask 0) before the observation."""
    encoder = ChatEncoder(tokenizer)
    long_answer = " ".join(["step"] * 40)
    trajectory = Trajectory(prompt=list(PROMPT))
    replies = [
        tokenizer(long_answer, add_special_tokens=False)["input_ids"],
        tokenizer("42", add_special_tokens=False)["input_ids"] + [encoder.end_of_turn_id],
    ]

    async def main():
        await run_trajectory(
            trajectory,
            backend=ScriptedBackend(replies),
            env=EnvRunner(ScriptedEnv(feedback("user", 2))),
            encoder=encoder,
            sampling=SamplingParams(max_new_tokens=10, stop_token_ids=encoder.stop_token_ids),
            limits=TurnLimits(max_turns=4),
        )

    anyio.run(main)
    first = trajectory.turns[0]
    assert first.finish_reason == "length" and first.num_generated == 10
    closing = trajectory.prompt_length + first.start + first.num_generated
    assert (
        trajectory.tokens[closing] == encoder.end_of_turn_id
        and trajectory.loss_mask[closing - trajectory.prompt_length] == 0
    )
    assert encoder.drift_check(trajectory).exact
    assert trajectory.stop_reason is StopReason.ENV_DONE


def test_images_without_a_processor_are_one_clear_error(tokenizer):
    encoder = ChatEncoder(tokenizer)
    with pytest.raises(ObservationError, match="holds images but the encoder has no VLM processor"):
        encoder.encode_observation({"role": "user", "content": [{"type": "image", "image": red_square(28)}]})


def test_an_image_that_does_not_decode_names_the_image(processor):
    encoder = ChatEncoder(processor.tokenizer, processor=processor)
    with pytest.raises(ObservationError, match="image 2 of 2 does not decode"):
        encoder.encode_observation(
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": red_square(28)},
                    {"type": "image", "image": "data:image/png;base64,AAAA"},
                ],
            }
        )


def test_tokenizer_without_chat_template_is_refused(tokenizer):
    bare = load_tokenizer("qwen2.5")
    bare.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        ChatEncoder(bare)


def test_a_developer_message_is_rendered_as_the_system_message(tokenizer):
    encoder = ChatEncoder(tokenizer)  # Qwen2.5's template renders a 'developer' message as nothing
    brief = {"content": "Answer in one word."}
    as_developer = encoder.encode_prompt([{"role": "developer", **brief}, {"role": "user", "content": "hi"}])
    as_system = encoder.encode_prompt([{"role": "system", **brief}, {"role": "user", "content": "hi"}])
    assert as_developer.token_ids == as_system.token_ids
    assert "Answer in one word." in tokenizer.decode(as_developer.token_ids)


def test_prefix_is_computed_once_per_role(tokenizer, monkeypatch):
    encoder = ChatEncoder(tokenizer, tools=TOOLS)
    cuts = []
    original = encoder._cut
    monkeypatch.setattr(encoder, "_cut", lambda text: cuts.append(1) or original(text))
    for i in range(5):
        encoder.encode_observation({"role": "user", "content": f"obs {i}"})
        encoder.encode_observation({"role": "tool", "content": f"result {i}"})
    assert len(cuts) == 1  # one per observation role, cached afterwards (the user role's when the encoder was built)


def test_packaged_templates_are_the_official_fixtures(templates_dir):
    assert packaged_template("qwen2.5") == (templates_dir / "Qwen2.5-7B-Instruct.jinja").read_text()
    assert packaged_template("qwen2.5-vl") == (templates_dir / "Qwen2.5-VL-7B-Instruct.jinja").read_text()


# -- from the event loop: the async variants -------------------------------------------------------------


def same_encoding(a, b) -> bool:
    if (a.token_ids, a.image_data) != (b.token_ids, b.image_data):
        return False
    if a.train_inputs is None or b.train_inputs is None:
        return a.train_inputs is b.train_inputs
    return a.train_inputs.keys() == b.train_inputs.keys() and all(
        torch.equal(a.train_inputs[k], b.train_inputs[k]) for k in a.train_inputs
    )


def encode_threads(monkeypatch, encoder: ChatEncoder) -> list[int]:
    """The thread each encode of `encoder` runs in."""
    threads, original = [], encoder._encode_text

    def spy(*args, **kwargs):
        threads.append(threading.get_ident())
        return original(*args, **kwargs)

    monkeypatch.setattr(encoder, "_encode_text", spy)
    return threads


def look_again(size: int, text: str = "Look again.") -> dict:
    return {"role": "user", "content": [{"type": "image", "image": red_square(size)}, {"type": "text", "text": text}]}


@pytest.mark.anyio
async def test_async_observations_run_in_a_thread_when_heavy_and_equal_the_sync_ones(processor, monkeypatch):
    encoder = ChatEncoder(processor.tokenizer, processor=processor, payloads=ImagePayloads())
    threads = encode_threads(monkeypatch, encoder)
    loop_thread = threading.get_ident()
    short = {"role": "user", "content": "Wrong, try again."}
    long_text = {"role": "tool", "content": "digit " * (INLINE_MAX_CHARS // 6 + 1)}
    long_parts = {"role": "user", "content": [{"type": "text", "text": "carry " * (INLINE_MAX_CHARS // 6 + 1)}]}
    cases = [(short, True), (long_text, False), (long_parts, False), (look_again(56), False)]
    for message, inline in cases:
        threads.clear()
        encoded = await encoder.aencode_observation(message)
        assert same_encoding(encoded, encoder.encode_observation(message))
        assert (threads[0] == loop_thread) is inline and threads[1] == loop_thread, message["role"]


@pytest.mark.anyio
async def test_async_prompts_and_drift_checks_run_in_a_thread_with_images(processor, monkeypatch):
    encoder = ChatEncoder(processor.tokenizer, processor=processor, payloads=ImagePayloads())
    threads = encode_threads(monkeypatch, encoder)
    loop_thread = threading.get_ident()
    text_prompt = [{"role": "user", "content": "What is 2 + 2?"}]
    image_prompt = [look_again(84, "What is drawn?")]
    rendered = encoder.render([{"role": "user", "content": [{"type": "image"}]}], add_generation_prompt=True)
    for prompt, images, inline in [
        (text_prompt, None, True),
        (image_prompt, None, False),
        (rendered, [red_square(28)], False),
    ]:
        threads.clear()
        encoded = await encoder.aencode_prompt(prompt, images)
        assert same_encoding(encoded, encoder.encode_prompt(prompt, images))
        assert (threads[0] == loop_thread) is inline
    for prompt, inline in [(text_prompt, True), (image_prompt, False)]:
        trajectory = Trajectory(prompt=prompt)
        encoded = encoder.encode_prompt(prompt)
        trajectory.set_prompt(encoded.token_ids)
        trajectory.image_data.extend(encoded.image_data)
        threads.clear()
        assert (await encoder.adrift_check(trajectory)) == encoder.drift_check(trajectory)
        assert (threads[0] == loop_thread) is inline


@pytest.mark.anyio
async def test_async_encoding_raises_what_the_sync_one_raises(processor):
    encoder = ChatEncoder(processor.tokenizer, processor=processor)
    broken = {"role": "user", "content": [{"type": "image", "image": "data:image/png;base64,AAAA"}]}
    with pytest.raises(ObservationError, match="image 1 of 1 does not decode"):
        await encoder.aencode_observation(broken)


@pytest.mark.anyio
async def test_one_encoder_in_many_threads_at_once_gives_the_sequential_results(processor, tokenizer):
    """The fast tokenizer, the processor and the templates are shared by every thread encoding at once."""
    vision = ChatEncoder(processor.tokenizer, processor=processor, payloads=ImagePayloads())
    text = ChatEncoder(tokenizer, tools=TOOLS)
    messages = [look_again(28 * (i % 5 + 1), f"Look again ({i}).") for i in range(8)]
    long_texts = [{"role": "user", "content": f"Feedback {i}: " + "try again " * 500} for i in range(8)]
    expected = [vision.encode_observation(m) for m in messages] + [text.encode_observation(m) for m in long_texts]
    vision.payloads.clear()
    encoded_before = vision.payloads.encodes
    results: dict[int, object] = {}
    limiter = anyio.CapacityLimiter(8)

    async def encode(i: int, encoder: ChatEncoder, message: dict) -> None:
        results[i] = await encoder.aencode_observation(message, limiter=limiter)

    async with anyio.create_task_group() as tg:
        for i, (encoder, message) in enumerate([(vision, m) for m in messages] + [(text, m) for m in long_texts]):
            tg.start_soon(encode, i, encoder, message)
    assert all(same_encoding(results[i], e) for i, e in enumerate(expected))
    # equal images encoded at once in several threads are encoded once
    assert vision.payloads.encodes - encoded_before == len({m["content"][0]["image"].size for m in messages})
