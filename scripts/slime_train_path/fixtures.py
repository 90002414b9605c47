"""What the run writes into its temp dir: geometry problems with PIL drawings and labels (JSONL, parquet),
an HF checkpoint dir (the tiny Qwen2.5-VL model and its processor, what slime's data source loads from
`--hf-checkpoint`), the custom config YAML, the eval config YAML and a reward-function module."""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

SIZE = 224  # within the tiny processor's max_pixels: 64 image tokens per drawing


@dataclass(frozen=True)
class Problem:
    id: str  # "G3": the scripted server finds it in the prompt
    text: str
    answer: str  # the label
    wrong: str  # the scripted wrong answer
    plan: tuple[int, ...]  # per sample of a group: 1 answers right, 0 wrong (scripted server)
    shape: str


PROBLEMS = (
    Problem(
        "G1",
        "Two angles of the triangle are 50 and 60 degrees. Find the third angle x.",
        "70",
        "80",
        (1, 1, 1, 1),
        "triangle",
    ),
    Problem(
        "G2", "The legs of the right triangle are 3 and 4. Find the hypotenuse c.", "5", "7", (0, 0, 0, 0), "right"
    ),
    Problem("G3", "The rectangle has sides 6 and 4. Find its area.", "24", "20", (1, 0, 1, 0), "rect"),
    Problem("G4", "The circle has radius 3. Find its diameter.", "6", "9", (1, 1, 0, 0), "circle"),
    Problem("G5", "The square has side 7. Find its perimeter.", "28", "49", (1, 0, 0, 0), "square"),
    Problem(
        "G6",
        "The isosceles triangle has apex angle 100 degrees. Find a base angle x.",
        "40",
        "80",
        (0, 1, 1, 1),
        "triangle",
    ),
    Problem(
        "G7", "Two angles on a straight line: one is 130 degrees. Find the other, x.", "50", "230", (1, 0, 1, 0), "line"
    ),
    Problem("G8", "The rectangle is 5 by 12. Find the length of its diagonal.", "13", "17", (0, 0, 1, 1), "rect"),
    Problem(
        "G9",
        "The equilateral triangle has side 2. Find its height h.",
        "\\sqrt{3}",
        "\\sqrt{2}",
        (1, 0, 0, 1),
        "triangle",
    ),
)

BY_ID = {p.id: p for p in PROBLEMS}


def prompt_text(problem: Problem) -> str:
    return (
        f"<image>\nProblem {problem.id}: {problem.text} Check your answer with the calc_score tool, "
        "then give the final answer as \\boxed{answer}."
    )


def draw(problem: Problem, path: Path) -> Path:
    image = Image.new("RGB", (SIZE, SIZE), "white")
    d = ImageDraw.Draw(image)
    numbers = [t for t in problem.text.replace(".", " ").replace(",", " ").split() if t.isdigit()]
    if problem.shape in ("triangle", "right"):
        corners = [(30, 190), (194, 190), (30 if problem.shape == "right" else 112, 40)]
        d.polygon(corners, outline="black", width=3)
    elif problem.shape in ("rect", "square"):
        d.rectangle(
            [40, 60 if problem.shape == "rect" else 40, 184, 164 if problem.shape == "rect" else 184],
            outline="black",
            width=3,
        )
    elif problem.shape == "circle":
        d.ellipse([42, 42, 182, 182], outline="black", width=3)
        d.line([112, 112, 182, 112], fill="black", width=2)
    else:  # two angles on a line
        d.line([20, 150, 204, 150], fill="black", width=3)
        d.line([112, 150, 170, 50], fill="black", width=3)
    for i, number in enumerate(numbers[:3]):
        d.text((40 + 60 * i, 10), number, fill="black")
    d.text((150, 200), problem.id, fill="blue")
    image.save(path)
    return path


def write_prompts(tmp: Path) -> dict[str, Path]:
    """The prompt rows as slime's Dataset reads them (`--input-key problem --label-key answer
    --multimodal-keys '{"image": "images"}'`): JSONL always, parquet when pyarrow is there."""
    images = tmp / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "problem": prompt_text(p),
            "answer": p.answer,
            "images": [str(draw(p, images / f"{p.id}.png"))],
            "metadata": {"problem_id": p.id},
        }
        for p in PROBLEMS
    ]
    paths = {"jsonl": tmp / "geo_prompts.jsonl"}
    paths["jsonl"].write_text("".join(json.dumps(row) + "\n" for row in rows))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return paths
    paths["parquet"] = tmp / "geo_prompts.parquet"
    pq.write_table(pa.Table.from_pylist(rows), paths["parquet"])
    return paths


def write_hf_checkpoint(tmp: Path) -> Path:
    """An HF checkpoint dir for `--hf-checkpoint`: the tiny random-weight Qwen2.5-VL model Turnstile's
    embedded default runs, with its processor (Qwen vocabulary and chat template, small image limits)."""
    from engine.models import load_model, load_processor

    path = tmp / "hf-tiny-qwen2.5-vl"
    load_processor("qwen2.5-vl").save_pretrained(path)
    load_model("tiny-qwen2.5-vl").save_pretrained(path)
    return path


def write_custom_config(tmp: Path, slime: Path, turnstile: dict, name: str) -> Path:
    """`--custom-config-path`: slime's geo3k multi-turn config (max_turns, the env path) as the checkout
    has it, plus the `turnstile:` section."""
    import yaml

    config = yaml.safe_load((slime / "examples/geo3k_vlm_multi_turn/geo3k_vlm_multi_turn_config.yaml").read_text())
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**config, "turnstile": turnstile}))
    return path


EVAL_NAME = "geo3k_eval"
EVAL_SLICE = (0, 4)
EVAL_RM_TYPE = "f1"  # not the train runs' --rm-type math: a dataset rm_type that is not honoured shows


def write_eval_config(tmp: Path, prompts: Path) -> Path:
    """`--eval-config`: one dataset, a slice of the train prompts, its own rm_type."""
    import yaml

    start, stop = EVAL_SLICE
    config = {
        "eval": {"datasets": [{"name": EVAL_NAME, "path": f"{prompts}@[{start}:{stop}]", "rm_type": EVAL_RM_TYPE}]}
    }
    path = tmp / "eval_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


RM_MODULE = "turnstile_train_path_rm"


def write_rm_module(tmp: Path) -> str:
    """A module of slime plug-ins, each recording its calls: `custom_rm` (`--custom-rm-path`, one sample),
    `group_rm` (with `--group-rm`: a group, dict rewards for `--reward-key acc`), `hook`
    (`--rollout-sample-hook-path`), `sample_filter` (`--rollout-sample-filter-path`: remove_sample on the
    last sample of each group) and `process_all` (`--rollout-all-samples-process-path`)."""
    (tmp / f"{RM_MODULE}.py").write_text(
        textwrap.dedent(
            '''
            """slime plug-ins for scripts/slime_train_path (written at run time)."""
            from slime.rollout.rm_hub.math_utils import extract_answer

            CALLS = []  # ("one", index, hooked) or ("group", [group_index, ...]) per call while RECORDING
            RECORDING = [True]
            HOOKED = []  # (index, rollout_id, reward when the hook ran)
            FILTERED = []  # group_index of each group given to sample_filter, per call
            PROCESSED = []  # (group_index of each group, data source class), per call


            def correct(sample):
                boxed = extract_answer(sample.response)
                return boxed is not None and boxed.strip() == str(sample.label).strip()


            async def custom_rm(args, sample, **kwargs):
                if RECORDING[0]:
                    CALLS.append(("one", sample.index, "hooked_at" in (sample.metadata or {})))
                return 2.0 if correct(sample) else -1.0


            async def group_rm(args, samples, **kwargs):
                if RECORDING[0]:
                    CALLS.append(("group", [s.group_index for s in samples]))
                accs = [1.0 if correct(s) else 0.0 for s in samples]
                mean = sum(accs) / len(accs)
                return [{"acc": acc, "group_mean": mean, "rank": i} for i, acc in enumerate(accs)]


            def hook(args, sample, rollout_id=None, evaluation=False):
                HOOKED.append((sample.index, rollout_id, sample.reward))
                sample.metadata = {**(sample.metadata or {}), "hooked_at": rollout_id}
                return sample


            def sample_filter(args, data):
                FILTERED.append([group[0].group_index for group in data])
                for group in data:
                    group[-1].remove_sample = True


            def process_all(args, all_samples, data_source):
                PROCESSED.append(([group[0].group_index for group in all_samples], type(data_source).__name__))
            '''
        )
    )
    return RM_MODULE
