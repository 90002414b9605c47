"""scripts/slime_loop (slime's train.py / train_async.py on Turnstile with a CPU trainer): what of it needs no
slime checkout, and, with TURNSTILE_SLIME_CHECKOUT set, a short run of slime's own train.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from scripts.slime_loop import report
from scripts.slime_loop.batches import freeze, invert_loss_masks, save_hf, window_logits, windows

ROOT = Path(__file__).resolve().parents[1]


def test_windows_keep_each_response_and_the_token_before_it():
    data = {"tokens": [torch.arange(10), torch.arange(20, 26)], "response_lengths": [3, 5]}
    windows(data)
    assert [t.tolist() for t in data["tokens"]] == [[6, 7, 8, 9], [20, 21, 22, 23, 24, 25]]
    assert data["total_lengths"] == [4, 6]
    assert [t.tolist() for t in data["full_tokens"]] == [list(range(10)), list(range(20, 26))]


def test_one_padded_forward_gives_each_samples_own_window_logits():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64)
    ).eval()  # fmt: skip
    samples, kept = [torch.randint(0, 64, (n,)) for n in (9, 4, 13)], [3, 4, 1]
    with torch.no_grad():
        batched = window_logits(model, samples, kept)
        alone = [model(input_ids=t.unsqueeze(0), logits_to_keep=w).logits for t, w in zip(samples, kept, strict=True)]
    assert batched.shape == (1, sum(kept), 64)
    torch.testing.assert_close(batched, torch.cat(alone, dim=1), rtol=1e-4, atol=1e-5)


def test_slimes_freeze_flags_leave_only_the_matched_parameters_to_train():
    from argparse import Namespace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    def trainable(**flags):
        model = Qwen2ForCausalLM(
            Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        )  # fmt: skip
        freeze(model, Namespace(**flags))
        return model, {name for name, p in model.named_parameters() if p.requires_grad}

    model, names = trainable(freeze_params_name_list=["embed_tokens"])
    assert "model.embed_tokens.weight" not in names and not model.lm_head.weight.requires_grad  # tied: both
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.norm.weight" in names
    _, names = trainable(only_train_params_name_list=[r"layers\.1\."], freeze_params_name_list=["mlp"])
    assert names and all(".layers.1." in n and ".mlp." not in n for n in names)  # slime's order: only, then freeze
    _, names = trainable()
    assert "model.embed_tokens.weight" in names
    with pytest.raises(ValueError, match="leave no parameter to train"):
        trainable(only_train_params_name_list=["no-such-parameter"])


def test_the_negative_control_trains_on_the_environments_tokens_with_slimes_mask_sums():
    data = {
        "loss_masks": [torch.tensor([1, 1, 0, 0, 0, 1]), torch.tensor([1, 0]), torch.tensor([1, 1])],
        "rollout_ids": [0, 0, 1],
        "rollout_mask_sums": torch.tensor([5.0, 5.0, 2.0]),
    }
    invert_loss_masks(data)
    assert [m.tolist() for m in data["loss_masks"]] == [[0, 0, 1, 1, 1, 0], [0, 1], [0, 0]]
    assert data["rollout_mask_sums"].tolist() == [4.0, 4.0, 0.0]  # each rollout's total, as slime sums them


def test_weights_appear_whole_or_not_at_all(tmp_path, monkeypatch):
    from engine.models import load_model

    model = load_model("tiny-qwen2")
    save_hf(model, tmp_path / "weight_v000001")
    assert {p.name for p in tmp_path.iterdir()} == {"weight_v000001"}  # no staging directory left
    assert (tmp_path / "weight_v000001" / "model.safetensors").exists()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(model), "save_pretrained", fail)
    with pytest.raises(OSError, match="disk full"):
        save_hf(model, tmp_path / "weight_v000002")
    assert {p.name for p in tmp_path.iterdir()} == {"weight_v000001"}


def write_run(tmp_path: Path, name: str, control: str, evals: list[float], mismatch: float, samples: int = 64):
    work = tmp_path / name
    work.mkdir()
    rows = [{"source": "eval", "rollout_id": 0, "reward": {"heldout": evals[0]}}]
    for step, reward in enumerate(evals[1:]):
        rows += [
            {"source": "rollout", "rollout_id": step, "samples": samples, "reward": reward, "removed": 0,
             "token_versions": {str(step + 1): 90, str(step): 10}},
            {"source": "trainer", "rollout_id": step, "trained_on_weight_version": step + 1,
             "train/train_rollout_logprob_abs_diff": mismatch},
            {"source": "eval", "rollout_id": step, "reward": {"heldout": reward}},
        ]  # fmt: skip
    (work / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "name": name, "work": str(work), "driver": "train", "backend": "embedded", "control": control, "seed": 0,
        "rc": 0, "wall_seconds": 1.0, "steps": len(evals) - 1, "prompts_per_step": 8, "samples_per_prompt": 8,
    }  # fmt: skip


def test_the_verdict_needs_a_rise_from_the_loss_and_none_from_the_control(tmp_path):
    learned = write_run(tmp_path, "run", "none", [0.2, 0.3, 0.4, 0.5, 0.6, 0.6], mismatch=0.01)
    flat_control = write_run(tmp_path, "control", "inverted_mask", [0.2, 0.2, 0.1, 0.2, 0.2, 0.2], mismatch=3.0)
    figures = [report.run_figures(r) for r in (learned, flat_control)]
    assert figures[0]["eval_rise"] == pytest.approx(0.3667, abs=1e-3)
    assert figures[0]["staleness"][1] == {"mean": pytest.approx(0.1), "max": 1}  # 10 of 100 tokens one behind
    assert report.verdict(figures) == {"passed": True, "problems": []}

    flat = write_run(tmp_path, "flat", "none", [0.2, 0.2, 0.2, 0.25, 0.2, 0.2], mismatch=0.01)
    lossy = write_run(tmp_path, "lossy", "none", [0.2, 0.3, 0.4, 0.5, 0.6, 0.6], mismatch=0.01, samples=56)
    unflagged = write_run(tmp_path, "sneaky", "inverted_mask", [0.2, 0.3, 0.4, 0.5, 0.6, 0.6], mismatch=0.01)
    problems = report.verdict([report.run_figures(r) for r in (flat, lossy, unflagged)])["problems"]
    assert [p.split(":")[0] for p in problems] == ["flat", "lossy", "sneaky"]
    assert "5 prompts lost" in problems[1]  # 8 samples short of 64 at each of 5 steps: a group of 8 each


def test_sglang_runs_need_a_trajectorys_turns_on_one_worker(tmp_path):
    routed = {"a": Counter({0: 3}), "b": Counter({1: 2}), "c": Counter({0: 4, 1: 1})}  # 9 of 10 turns on their worker
    assert report.affinity(routed) == {"share": 0.9, "trajectories": 3, "turns": 10}
    run = write_run(tmp_path, "scattered", "none", [0.2, 0.3, 0.4, 0.5, 0.6, 0.6], mismatch=0.01)
    run |= {"backend": "sglang", "affinity": report.affinity(routed)}
    assert report.verdict([report.run_figures(run)])["problems"] == [
        "scattered: 0.9 of a trajectory's turns on one worker (< 0.95)"
    ]
    run["affinity"] = report.affinity({"a": Counter({0: 3}), "b": Counter({1: 2})})
    assert report.verdict([report.run_figures(run)]) == {"passed": True, "problems": []}


@pytest.mark.skipif(
    not os.environ.get("TURNSTILE_SLIME_CHECKOUT"),
    reason="set TURNSTILE_SLIME_CHECKOUT to a slime checkout to run slime's own train.py on Turnstile",
)
@pytest.mark.parametrize("shards", [1, 2], ids=["one_engine", "two_rollout_shards"])
def test_slimes_train_py_runs_two_steps_on_the_embedded_model(tmp_path, shards):
    """slime's own train.py, two steps; with two shards (`turnstile: {shards: 2}`), Ray actors that slime's rollout
    manager creates and decides for."""
    checkout = os.environ["TURNSTILE_SLIME_CHECKOUT"]
    cmd = [sys.executable, "-m", "scripts.slime_loop.main", checkout, "--out", str(tmp_path), "--drivers", "train",
           "--seeds", "0", "--controls", "none", "--steps", "2", "--shards", str(shards)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, timeout=900, check=False)
    summary = json.loads((tmp_path / "report.json").read_text())
    (run,) = summary["runs"]
    assert run["rc"] == 0 and run["steps_trained"] == 2 and run["prompts_lost"] == 0
    assert len(run["eval_reward"]) == 3  # before training, then after each step
    assert run["mismatch"][0] == pytest.approx(0.0, abs=1e-4)  # step 0: the trainer's weights made every token
    assert sorted(p.name for p in (tmp_path / run["name"] / "weights").iterdir())[:3] == [
        "weight_v000001", "weight_v000002", "weight_v000003",
    ]  # fmt: skip


@pytest.mark.skipif(
    not os.environ.get("TURNSTILE_SLIME_CHECKOUT"),
    reason="set TURNSTILE_SLIME_CHECKOUT to a slime checkout to run slime's own train.py on SGLang servers",
)
def test_slimes_train_py_runs_on_two_sglang_servers_behind_the_router_slime_starts(tmp_path):
    from tests.sglang_cpu.server import is_installed, venv_dir

    if not is_installed():
        pytest.skip(f"no SGLang venv at {venv_dir()}: run `make sglang`")
    checkout = os.environ["TURNSTILE_SLIME_CHECKOUT"]
    cmd = [sys.executable, "-m", "scripts.slime_loop.main", checkout, "--out", str(tmp_path), "--drivers", "train",
           "--seeds", "0", "--controls", "none", "--steps", "2", "--backend", "sglang"]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, timeout=1800, check=False)
    (run,) = json.loads((tmp_path / "report.json").read_text())["runs"]
    assert run["rc"] == 0 and run["steps_trained"] == 2 and run["prompts_lost"] == 0
    assert run["affinity"]["share"] >= 0.95 and run["affinity"]["trajectories"] > 0
    assert run["staleness"]["1"]["max"] == 1  # step 1 trained on tokens the servers made with step 0's weights
    assert not any((tmp_path / run["name"] / "weights").iterdir())  # slime removed each directory after the reload


def test_a_right_answer_after_a_wrong_one_earns_the_later_credit():
    from types import SimpleNamespace

    from bridge.convert import Sample
    from scripts.slime_loop import task

    row = task.question_row(2, 3)
    sample = Sample(prompt=row["messages"], label=row["label"], metadata=row["metadata"])
    args = SimpleNamespace(max_turns=2, loop_later_credit=0.25)
    first = task.build_env(sample, args)
    first.reset()
    assert first.step("5") == ({"obs_str": "Correct."}, True, {"attempts": 1, "guess": 5, "reward": 1.0})
    later = task.build_env(sample, args)
    later.reset()
    observation, done, info = later.step("4")
    assert not done and "4 is not right" in observation["obs_str"] and "reward" not in info
    assert later.step("5")[1:] == (True, {"attempts": 2, "guess": 5, "reward": 0.25})


def test_the_warm_start_says_how_often_its_first_answer_is_right_and_the_report_shows_it(tmp_path):
    from scripts.slime_loop import task
    from scripts.slime_loop.task import QUESTIONS, WARM_START_FILE

    checkpoint = task.warm_start(tmp_path / "warm", seed=0, hidden_size=16, steps=2)
    learned = json.loads((checkpoint / WARM_START_FILE).read_text())
    assert len(learned["p_right_first"]) == len(QUESTIONS) and all(0 < p < 1 for p in learned["p_right_first"])
    assert learned["mean"] == pytest.approx(sum(learned["p_right_first"]) / len(QUESTIONS))
    run = write_run(tmp_path, "run", "none", [0.2, 0.3, 0.4, 0.5], mismatch=0.01) | {"hf_checkpoint": str(checkpoint)}
    assert report.run_figures(run)["warm_start"] == learned


def test_the_loop_can_drop_groups_that_all_earned_the_same_with_slimes_own_filter(tmp_path):
    """The default, `--dynamic-filter zero-std-fallback`, makes slime's check_reward_nonzero_std_with_fallback the
    run's --dynamic-sampling-filter-path (with the over-sampling margin it drops from); 'zero-std' its strict
    check_reward_nonzero_std; 'none' no filter; a name of none of them is refused."""
    from scripts.slime_loop import main, run
    from scripts.slime_train_path.slime_args import to_argv

    spec = {
        "hf_checkpoint": "m", "train_data": "t", "eval_data": "e", "custom_config": "c", "seed": 0, "steps": 1,
        "prompts_per_step": 2, "samples_per_prompt": 2, "train_steps_per_rollout": 1, "eval_samples_per_prompt": 1,
        "lr": 1e-4, "backend": "embedded",
    }  # fmt: skip
    assert main.FILTERS[main.parse(["/slime", "--dynamic-filter", "none"]).dynamic_filter] is None
    with pytest.raises(SystemExit):
        main.parse(["/slime", "--dynamic-filter", "zero_std"])
    strict = main.FILTERS[main.parse(["/slime", "--dynamic-filter", "zero-std"]).dynamic_filter]
    assert strict == "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
    chosen = main.FILTERS[main.parse(["/slime"]).dynamic_filter]
    assert chosen == "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback"
    argv = to_argv(run.slime_flags({**spec, "dynamic_filter": chosen, "partial_rollout": True}, tmp_path))
    assert argv[argv.index("--dynamic-sampling-filter-path") + 1] == chosen
    # the margin it drops from: slime's over-sampling round, twice the step's prompts
    assert int(argv[argv.index("--over-sampling-batch-size") + 1]) == 2 * spec["prompts_per_step"]
    assert "--dynamic-sampling-filter-path" not in to_argv(run.slime_flags({**spec, "dynamic_filter": None}, tmp_path))
    checkout = os.environ.get("TURNSTILE_SLIME_CHECKOUT")
    if checkout:  # the paths name slime's own functions
        for path in (strict, chosen):
            module, _, name = path.rpartition(".")
            assert f"def {name}(" in (Path(checkout) / (module.replace(".", "/") + ".py")).read_text()
