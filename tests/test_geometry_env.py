"""The geometry env: seeded problems drawn to scale, the answer rule on its table of forms, episodes with
scripted answers (hint images in tool observations), and `turnstile run --env geometry` end to end on the
embedded default and against a real SGLang server."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image, ImageChops

from engine.cli import main
from engine.encoding import ChatEncoder
from engine.envs.builtin import resolve_env_path
from engine.envs.geometry import GeometryEnv, build_env, make_prompts
from engine.envs.geometry.answer_forms import ANSWER_FORMS, disagreements
from engine.envs.geometry.drawing import DEFAULT_SIZE, FOCUS_INK, Angle, Label, Segment, render
from engine.envs.geometry.grader import evaluate, extract_answer, grade, is_equivalent, normalize, slime_rule
from engine.envs.geometry.problems import KINDS, generate
from engine.envs.loader import EnvFactory, EnvSample

NUMBER = re.compile(r"\d+")


def env_for(row: dict, **kw) -> GeometryEnv:
    env = build_env(EnvSample.from_row(row), **kw)
    env.reset()
    return env


def non_white(image: Image.Image) -> int:
    return int((np.asarray(image) != 255).any(axis=2).sum())


def reds(image: Image.Image) -> int:
    """Pixels of the highlight's red (after resampling too)."""
    r, g, b = np.asarray(image).astype(int).transpose(2, 0, 1)
    return int(((r > 150) & (g < 90) & (b < 90)).sum())


def differs(a: Image.Image, b: Image.Image) -> bool:
    return ImageChops.difference(a, b).getbbox() is not None


# -- problems and figures ----------------------------------------------------------------------------


def test_make_prompts_is_seeded_and_takes_every_kind_in_turn():
    rows, again = make_prompts(len(KINDS), seed=3, vision=True), make_prompts(len(KINDS), seed=3, vision=True)
    assert [r["metadata"]["kind"] for r in rows] == list(KINDS)
    for row, same in zip(rows, again, strict=True):
        assert (row["label"], row["metadata"]) == (same["label"], same["metadata"])
        image, text = row["prompt"][0]["content"]
        assert not differs(image["image"], same["prompt"][0]["content"][0]["image"])
        assert "\\boxed{...}" in text["text"]
    other = make_prompts(len(KINDS), seed=4)
    assert [r["label"] for r in other] != [r["label"] for r in rows]
    assert all(isinstance(r["prompt"][0]["content"], str) for r in other)  # text mode: the figure in words
    json.dumps(make_prompts(3, vision=False))  # rows (metadata included) are plain JSON


@pytest.mark.parametrize("kind", KINDS)
def test_each_answer_is_the_exact_value_and_every_given_number_is_drawn(kind):
    for seed in range(20):
        problem = generate(seed, kind)
        assert math.isclose(evaluate(normalize(problem.answer)), problem.value, rel_tol=1e-9)
        texts = [item.text if isinstance(item, Label) else getattr(item, "label", "") for item in problem.figure.items]
        drawn = {n for text in texts for n in NUMBER.findall(text)}
        assert set(NUMBER.findall(problem.description)) <= drawn, (problem.description, texts)


@pytest.mark.parametrize("kind", KINDS)
def test_figures_are_drawn_to_scale(kind):
    """Sides labelled with numbers are drawn in proportion to them; labelled angles have the size they say."""
    for seed in range(20):
        items = generate(seed, kind).figure.items
        ratios = [
            math.dist(item.a, item.b) / float(NUMBER.findall(item.label)[-1])
            for item in items
            if isinstance(item, Segment) and NUMBER.search(item.label)
        ]
        assert all(math.isclose(r, ratios[0], rel_tol=1e-9) for r in ratios), ratios
        for item in items:
            if isinstance(item, Angle) and item.label.endswith("°"):
                assert math.isclose(_degrees(item), float(item.label[:-1]), abs_tol=1e-6)


def _degrees(angle: Angle) -> float:
    u = (angle.p[0] - angle.vertex[0], angle.p[1] - angle.vertex[1])
    v = (angle.q[0] - angle.vertex[0], angle.q[1] - angle.vertex[1])
    return math.degrees(math.acos((u[0] * v[0] + u[1] * v[1]) / (math.hypot(*u) * math.hypot(*v))))


@pytest.mark.parametrize("kind", KINDS)
def test_images_are_sized_drawn_and_labelled_and_hints_change_them(kind):
    figure = generate(0, kind).figure
    plain = render(figure)
    assert plain.size == DEFAULT_SIZE and plain.mode == "RGB"
    assert non_white(plain) > 500
    assert differs(plain, render(figure, labels=False))  # the labels are drawn
    hinted = render(figure, highlight=True, hint="a hint")
    assert reds(hinted) > 20 and reds(plain) == 0  # the unknown is marked
    assert tuple(FOCUS_INK) in {tuple(p) for p in np.asarray(hinted).reshape(-1, 3).tolist()}
    zoomed = render(figure, highlight=True, zoom=True)
    assert zoomed.size == DEFAULT_SIZE and differs(zoomed, hinted) and reds(zoomed) > 20


# -- the answer rule ---------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ANSWER_FORMS, ids=lambda f: f"{f.given!r} vs {f.truth!r}")
def test_the_own_rule_on_the_table_of_answer_forms(form):
    assert is_equivalent(form.given, form.truth) is form.is_correct


def test_the_own_rule_agrees_with_slimes_on_the_table_from_a_checkout():
    checkout = os.environ.get("TURNSTILE_SLIME_CHECKOUT")
    if not checkout:
        pytest.skip("set TURNSTILE_SLIME_CHECKOUT to a slime checkout to compare with slime's math rule")
    path = Path(checkout) / "slime/rollout/rm_hub/math_utils.py"
    spec = importlib.util.spec_from_file_location("slime_math_utils", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        pytest.skip(f"{path} does not import here ({exc}): it needs sympy and pylatexenc")
    slime = lambda given, truth: module.grade_answer_verl(f"\\boxed{{{given}}}", truth)
    assert disagreements(slime, is_slime=True) == []
    assert disagreements(is_equivalent, is_slime=False) == []


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("so x = 13. \\boxed{13}", "13"),
        ("first \\boxed{12}, no: \\boxed{\\frac{5\\sqrt{2}}{2}}", "\\frac{5\\sqrt{2}}{2}"),
        ("The sides give 13.\nAnswer: 13 cm.", "13 cm"),
        ("the answer is: 25\\pi", "25\\pi"),
        ("\\boxed{13", None),
        ("I do not know", None),
    ],
)
def test_the_final_answer_is_the_last_box_else_the_answer_line(response, answer):
    assert extract_answer(response) == answer


def test_grade_uses_the_own_rule_where_slime_does_not_import_and_refuses_a_bad_rule():
    if slime_rule() is not None:
        pytest.skip("slime imports here: the auto rule is slime's")
    verdict = grade("\\boxed{7.07}", ["5\\sqrt{2}", "7.07"])
    assert (verdict.answer, verdict.is_correct, verdict.rule) == ("7.07", True, "own")
    with pytest.raises(ValueError, match="grader rule 'slime': slime.rollout.rm_hub.math_utils does not import"):
        grade("\\boxed{1}", ["1"], rule="slime")
    with pytest.raises(ValueError, match="grader rule must be 'auto', 'slime' or 'own', got 'sympy'"):
        grade("\\boxed{1}", ["1"], rule="sympy")


# -- episodes ----------------------------------------------------------------------------------------


def test_a_wrong_answer_gets_a_tool_message_with_a_hint_image_then_a_right_one_ends_it(processor):
    row = make_prompts(2, vision=True)[1]  # right_hypotenuse
    env = env_for(row)
    observation, done, info = env.step("The hypotenuse is \\boxed{12}.")
    assert not done and (info["answer"], info["correct"]) == ("12", False)
    assert "12 is not right. Hint: Pythagoras" in observation["obs_str"]
    [hint_image] = observation["multi_modal_data"]["image"]
    assert differs(hint_image, row["prompt"][0]["content"][0]["image"])
    message = env.format_observation(observation)
    assert message["role"] == "tool" and message["content"][0] == {"type": "image", "image": hint_image}
    encoded = ChatEncoder(processor.tokenizer, processor=processor).encode_observation(message)
    assert len(encoded.image_data) == 1 and processor.image_token_id in encoded.token_ids
    assert encoded.train_inputs["pixel_values"].shape[0] > 0

    observation, done, info = env.step(f"a^2 + b^2 = 169, so\nAnswer: {row['label']}")
    assert done and info["correct"] and info["reward"] == 0.5  # right at the second attempt
    assert "multi_modal_data" not in observation


def test_every_attempt_wrong_ends_with_reward_0_and_the_later_image_is_a_zoom():
    row = make_prompts(3, vision=True)[2]
    env = env_for(row, max_attempts=3)
    first, _, _ = env.step("\\boxed{1}")
    second, done, _ = env.step("no idea")
    assert not done and "No final answer found" in second["obs_str"] and "zooms in on x" in second["obs_str"]
    assert differs(first["multi_modal_data"]["image"][0], second["multi_modal_data"]["image"][0])
    observation, done, info = env.step("\\boxed{2}")
    assert done and info["reward"] == 0.0 and row["label"] in observation["obs_str"]
    env.reset()  # replay-safe: the same answers rebuild the same state
    assert env.step("\\boxed{1}")[0]["obs_str"] == first["obs_str"]


def test_text_mode_describes_the_figure_and_sends_no_images(tokenizer):
    row = make_prompts(4, seed=1)[3]  # circle_area
    assert "radius" in row["prompt"][0]["content"]
    env = env_for(row, retry_discount=1.0)
    observation, done, _ = env.step("\\boxed{3}")
    assert not done and "multi_modal_data" not in observation
    assert ChatEncoder(tokenizer).encode_observation(env.format_observation(observation)).image_data == []
    decimal = row["metadata"]["answers"][1]
    assert env.step(f"Answer: {decimal}")[2]["reward"] == 1.0  # a rounded decimal counts; plain 1/0 reward


def test_build_env_reads_its_settings_and_refuses_rows_it_cannot_grade():
    row = make_prompts(1)[0]
    assert build_env(EnvSample.from_row(row), SimpleNamespace(max_turns=5)).max_attempts == 5
    assert build_env(EnvSample.from_row(row), SimpleNamespace(max_turns=5), max_attempts=2).max_attempts == 2
    own = build_env(EnvSample(prompt="a geo3k problem", label="3\\sqrt{3}"))  # a dataset of its own: text feedback
    own.reset()
    assert own.problem is None and own.step("\\boxed{\\sqrt{27}}")[2]["correct"]
    with pytest.raises(ValueError, match="problem_seed 0 \\(triangle_angle\\) has answer '42', but the sample's"):
        build_env(EnvSample.from_row({**row, "label": "41"}))
    with pytest.raises(ValueError, match="needs metadata\\['problem_seed'\\] \\(a row from make_prompts\\) or a"):
        build_env(EnvSample(prompt="no label"))
    with pytest.raises(ValueError, match="unknown geometry problem kind 'hexagon'"):
        build_env(EnvSample.from_row({**row, "metadata": {"problem_seed": 1, "kind": "hexagon"}, "label": None}))
    with pytest.raises(ValueError, match="retry_discount must be in \\[0, 1\\], got 2.0"):
        build_env(EnvSample.from_row(row), retry_discount=2.0)
    factory = EnvFactory(resolve_env_path("geometry"))
    assert isinstance(factory(EnvSample.from_row(row)).env, GeometryEnv)


# -- end to end --------------------------------------------------------------------------------------


def check_run(out: Path, processor, *, vision: bool) -> list[dict]:
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    vision_start = processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    for record in records:
        assert record["status"] in {"completed", "truncated"} and record["reward"] in {0.0, 0.5, 1.0}
        tokens, start = record["tokens"], record["prompt_length"]
        response = tokens[start:]
        assert len(record["loss_mask"]) == len(response)
        observed = [t for t, mask in zip(response, record["loss_mask"], strict=True) if mask == 0]
        fed_back = [t for t in record["turns"] if t["num_observation"]]
        if vision:  # the prompt's image and one per feedback observation reached the model
            assert tokens[:start].count(vision_start) == 1
            assert observed.count(vision_start) == len(fed_back) >= 1
            assert record["num_images"] == 1 + len(fed_back)
        else:
            assert record["num_images"] == 0 and vision_start not in tokens
    return records


@pytest.mark.parametrize("vision", [True, False], ids=["vision", "text"])
def test_turnstile_run_env_geometry_on_the_embedded_default(tmp_path, processor, vision):
    out = tmp_path / "geometry.jsonl"
    argv = ["run", "--env", "geometry", "--num-prompts", "2", "--max-turns", "2", "--max-new-tokens", "8"]
    assert main([*argv, *(["--vision"] if vision else []), "--out", str(out)]) == 0
    check_run(out, processor, vision=vision)


@pytest.mark.sglang
def test_turnstile_run_env_geometry_against_a_real_sglang_server(tmp_path, processor, sglang_workers):
    out = tmp_path / "geometry-sglang.jsonl"
    argv = ["run", "--env", "geometry", "--vision", "--backend", "sglang", "--url", sglang_workers[0].url]
    assert main([*argv, "--num-prompts", "2", "--max-turns", "2", "--max-new-tokens", "8", "--out", str(out)]) == 0
    records = check_run(out, processor, vision=True)
    assert all(record["weight_versions"] for record in records)
