"""The bridge as slime's rollout, flag by flag: samples slime's trainer accepts (`rollout_id` per
trajectory, rewards by slime's rule, `remove_sample`), its reward, filter and sample hooks with slime's
signatures, rendered prompts, stop strings, seeds and budgets, refused flags, and eval datasets.

slime is not importable here, so its hooks are functions in tests/hooks.py loaded by path, as slime
loads them; scripts/slime_train_path.sh runs slime's own code on the bridge's output."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from bridge.flags import FLAGS, FlagError, Handling, markdown_table
from bridge.rewards import HookError
from bridge.service import RolloutService
from bridge.settings import settings_from_args
from bridge.slime import SERVICE_ATTRIBUTE, generate_rollout
from engine.encoding import ChatEncoder
from engine.engine import StepFailedError
from tests import hooks
from tests.fakes import DeterministicBackend
from tests.test_bridge import DataSource

SLIME_DOC = Path(__file__).resolve().parents[1] / "docs" / "slime.md"


def slime_args(**flags) -> SimpleNamespace:
    """slime's args for a small run: 2 groups of 2 a step, slime's example env (it reports a `score`,
    never a reward), short turns. The router named is never reached: `run` gives the service its backend."""
    base = dict(
        n_samples_per_prompt=2, rollout_batch_size=2, max_turns=2, rollout_max_response_len=256,
        sglang_router_ip="127.0.0.1", sglang_router_port=9,
        rollout_interaction_env_path="tests.envs.slime_style_env", turnstile={"max_new_tokens": 16},
    )  # fmt: skip
    return SimpleNamespace(**{**base, **flags})


def run(args: SimpleNamespace, steps: int = 1, source=None, backend=None):
    """`steps` calls of generate_rollout on a deterministic model; the outputs and the data source."""
    backend = backend or DeterministicBackend(stop_every=10)
    setattr(args, SERVICE_ATTRIBUTE, RolloutService(settings_from_args(args), env_args=args, backend=backend))
    source = source or DataSource(n_samples=args.n_samples_per_prompt)
    try:
        return [generate_rollout(args, step, source) for step in range(steps)], source
    finally:
        getattr(args, SERVICE_ATTRIBUTE).shutdown()


@pytest.fixture(autouse=True)
def fresh_calls():
    hooks.CALLS.clear()


def samples_of(out) -> list:
    return [s for group in out.samples for s in group]


# -- samples slime's trainer accepts ---------------------------------------------------------------


def test_rewards_come_from_the_custom_rm_path_when_the_env_gives_none():
    [out], _ = run(slime_args(custom_rm_path="tests.hooks.length_rm"))
    samples = samples_of(out)
    assert len(samples) == 4
    for sample in samples:
        assert sample.reward == hooks.length_reward(sample)  # what the hook computes on the returned sample
        assert sample.rollout_id is None  # slime then gives every sample a rollout of its own
    assert sorted(index for name, index in hooks.CALLS if name == "length_rm") == sorted(s.index for s in samples)


def test_group_rm_scores_each_group_once_with_all_its_members():
    [out], _ = run(slime_args(custom_rm_path="tests.hooks.rank_group_rm", group_rm=True))
    calls = [members for name, members in hooks.CALLS if name == "rank_group_rm"]
    assert sorted(map(sorted, calls)) == sorted(sorted(s.index for s in g) for g in out.samples)
    for group in out.samples:
        assert sorted(s.reward for s in group) == [0.0, 1.0]


def test_without_any_reward_the_step_fails_fast_naming_why():
    """The env reports only a `score` and no reward function is set: nothing trains on a made-up 0.0, and
    a step where every sample failed raises one error naming the error class and its cause."""
    with pytest.raises(StepFailedError, match=r"4 of 4 trajectories .* FAILED .* reward x4 .*no reward"):
        run(slime_args())


def test_without_any_reward_the_samples_fail_and_say_why_when_failed_steps_are_allowed():
    [out], _ = run(slime_args(turnstile={"max_new_tokens": 16, "max_failed_share": 1.0}))
    for sample in samples_of(out):
        assert sample.status.value == "failed" and sample.remove_sample and sample.reward == 0.0
        assert "no reward" in sample.metadata["failure"] and sample.metadata["stop_reason"] == "reward_error"


def test_a_sample_that_fails_to_convert_fails_alone_and_its_group_stays_whole():
    [out], _ = run(
        slime_args(
            custom_rm_path="tests.hooks.length_rm", rollout_sample_hook_path=["tests.hooks.break_first_sample"],
            turnstile={"max_new_tokens": 16, "max_failed_share": 1.0},
        )
    )  # fmt: skip
    assert [len(group) for group in out.samples] == [2, 2]
    for sample in samples_of(out):
        broken = sample.index % 2 == 0
        assert (sample.status.value == "failed") == broken and sample.remove_sample == broken
        if broken:
            assert "ValueError('hook bug')" in sample.metadata["failure"] and sample.response_length == 0
            assert sample.loss_mask == [] and sample.reward == 0.0


def test_an_rm_type_without_slimes_rm_hub_is_refused_at_start():
    args = slime_args(rm_type="math")
    with pytest.raises(HookError, match=r"--rm-type 'math' is slime's reward rule .* --custom-rm-path"):
        generate_rollout(args, 0, DataSource(n_samples=2))


def test_rollout_sample_hooks_run_on_every_sample_before_its_reward():
    [out], _ = run(
        slime_args(custom_rm_path="tests.hooks.length_rm", rollout_sample_hook_path=["tests.hooks.mark_sample"])
    )
    samples = samples_of(out)
    marked = {index: (rollout_id, evaluation, reward) for name, (index, rollout_id, evaluation, reward) in
              ((c[0], c[1]) for c in hooks.CALLS if c[0] == "mark_sample")}  # fmt: skip
    assert sorted(marked) == sorted(s.index for s in samples)
    assert all(v == (0, False, None) for v in marked.values())  # before the reward, with slime's keywords
    scored = {index for name, index in hooks.CALLS if name == "length_rm"}
    for sample in samples:
        assert sample.metadata["hooked"] == [0, False]
        if sample.index == 0:  # the hook gave it a reward: slime's rule leaves it unscored
            assert sample.reward == 5.0 and 0 not in scored
        else:
            assert sample.reward == hooks.length_reward(sample) and sample.index in scored


def test_the_dynamic_filter_drops_groups_counts_and_replaces_them_then_the_batch_hooks_run():
    args = slime_args(
        custom_rm_path="tests.hooks.length_rm", dynamic_sampling_filter_path="tests.hooks.keep_odd_groups",
        rollout_sample_filter_path="tests.hooks.remove_every_third",
        rollout_all_samples_process_path="tests.hooks.see_all_samples",
    )  # fmt: skip
    [out], source = run(args)
    kept = [g[0].group_index for g in out.samples]
    assert len(kept) == 2 and all(i % 2 == 1 for i in kept) and kept == sorted(kept)
    dropped = sorted(set(source.handed_out) - set(kept))
    assert dropped and all(i % 2 == 0 for i in dropped)
    assert out.metrics["rollout/dynamic_filter/drop_even_group"] == len(dropped)
    # the batch hooks, after the step: the sample filter on the kept groups, the all-samples hook on all
    [filtered] = [groups for name, groups in hooks.CALLS if name == "remove_every_third"]
    [(everything, data_source)] = [v for name, v in hooks.CALLS if name == "see_all_samples"]
    assert filtered == kept and everything == sorted(kept + dropped) and data_source is source
    for sample in samples_of(out):
        assert sample.remove_sample == (sample.index % 3 == 0 or sample.status.value == "failed")


def test_rendered_prompts_go_to_the_model_as_they_are(tokenizer):
    """slime's --apply-chat-template hands over text; its tokens are the prompt's, unchanged."""

    class RenderedSource(DataSource):
        def get_samples(self, num):
            groups = super().get_samples(num)
            for group in groups:
                for sample in group:
                    messages = [{"role": "user", "content": f"{sample.prompt}: say something"}]
                    sample.prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return groups

    args = slime_args(apply_chat_template=True, custom_rm_path="tests.hooks.length_rm")
    [out], _ = run(args, source=RenderedSource(n_samples=2))
    for sample in samples_of(out):
        prompt_ids = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
        assert sample.tokens[: len(prompt_ids)] == prompt_ids
        assert len(sample.tokens) == len(prompt_ids) + sample.response_length
        assert sample.status.value in ("completed", "truncated")


class Recording(DeterministicBackend):
    """Keeps the sampling parameters of every request."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.params = []

    async def generate(self, input_ids, sampling_params, *args, **kwargs):
        self.params.append(sampling_params)
        return await super().generate(input_ids, sampling_params, *args, **kwargs)


def test_slimes_sampling_flags_reach_every_request():
    backend = Recording(stop_every=10)
    args = slime_args(
        custom_rm_path="tests.hooks.length_rm", rollout_stop=["###"], rollout_stop_token_ids=[42],
        rollout_skip_special_tokens=True, sglang_enable_deterministic_inference=True, rollout_seed=7,
        rollout_temperature=0.7, rollout_top_k=20, turnstile={},
    )  # fmt: skip
    run(args, backend=backend)
    assert backend.params
    for params in backend.params:
        assert params.stop == ("###",) and 42 in params.stop_token_ids and params.skip_special_tokens
        assert (params.temperature, params.top_k) == (0.7, 20)
        assert params.to_sglang()["no_stop_trim"] is True
    assert {p.sampling_seed for p in backend.params} == {7, 8}  # rollout_seed + index in group
    # no per-turn cap unless turnstile.max_new_tokens asks for one: the first turn may use the whole budget
    assert max(p.max_new_tokens for p in backend.params) == 256


def test_running_out_of_the_response_budget_is_truncated():
    args = slime_args(custom_rm_path="tests.hooks.length_rm", rollout_max_response_len=12, turnstile={})
    [out], _ = run(args, backend=DeterministicBackend(stop_every=1_000_000))
    for sample in samples_of(out):
        assert sample.status.value == "truncated" and sample.metadata["stop_reason"] == "token_budget"
        assert sample.response_length == 12 and not sample.remove_sample


def test_refused_flags_fail_at_start_in_one_error_naming_each():
    args = slime_args(rollout_top_p=0.9, use_rollout_routing_replay=True, custom_generate_function_path="my.gen")
    with pytest.raises(FlagError) as error:
        generate_rollout(args, 0, DataSource(n_samples=2))
    message = str(error.value)
    for option in ("--rollout-top-p 0.9", "--use-rollout-routing-replay True", "--custom-generate-function-path"):
        assert option in message
    assert "rollout_top_p_token_ids" in message  # and why


def test_eval_with_group_rm_is_refused_as_slimes_eval_refuses_it():
    with pytest.raises(FlagError, match="--group-rm"):
        generate_rollout(
            slime_args(group_rm=True, custom_rm_path="tests.hooks.rank_group_rm"), 0, None, evaluation=True
        )


def test_the_slime_doc_lists_every_rollout_flag_as_the_registry_has_it():
    assert markdown_table() in SLIME_DOC.read_text()
    options = [flag.option for flag in FLAGS]
    assert len(options) == len(set(options)) and {f.handling for f in FLAGS} == set(Handling)


# -- chat template kwargs and tools in observations ----------------------------------------------

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_template_kwargs_shape_every_observation_not_just_the_prompt(tokenizer):
    """Qwen3's enable_thinking=False writes an empty think block after every generation prompt: an
    observation encoded without the kwargs would lose it after the first turn."""
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = THINKING_TEMPLATE
    message = {"role": "user", "content": "try again"}
    plain = tokenizer.decode(ChatEncoder(tokenizer).encode_observation(message).token_ids)
    kwargs = ChatEncoder(tokenizer, chat_template_kwargs={"enable_thinking": False})
    assert tokenizer.decode(kwargs.encode_observation(message).token_ids).endswith("<think>\n\n</think>\n\n")
    assert "<think>" not in plain


def test_qwen3s_own_template_keeps_thinking_off_in_observations(tokenizer, templates_dir):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = (templates_dir / "Qwen3-0.6B.jinja").read_text()
    encoder = ChatEncoder(tokenizer, chat_template_kwargs={"enable_thinking": False})
    text = tokenizer.decode(encoder.encode_observation({"role": "user", "content": "again"}).token_ids)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# -- eval ------------------------------------------------------------------------------------------


def write_prompts(path: Path, n: int) -> None:
    path.write_text("".join(json.dumps({"input": f"eval prompt {i}", "answer": str(i)}) + "\n" for i in range(n)))


def eval_config(name: str, path: str, **fields) -> SimpleNamespace:
    """An eval dataset entry shaped as slime's EvalDatasetConfig (after slime resolved its defaults)."""
    base = dict(
        name=name, path=path, input_key="input", label_key="answer", metadata_key="metadata", tool_key=None,
        multimodal_keys=None, apply_chat_template=None, apply_chat_template_kwargs=None, rm_type=None,
        custom_rm_path=None, n_samples_per_eval_prompt=2, temperature=0.5, top_p=1.0, top_k=-1,
        max_response_len=20, stop=None, stop_token_ids=None, min_new_tokens=None, repetition_penalty=None,
        skip_special_tokens=None, custom_generate_function_path=None, metadata_overrides={},
    )  # fmt: skip
    return SimpleNamespace(**{**base, **fields})


def test_eval_datasets_run_with_their_own_settings_slices_and_rewards(tmp_path):
    write_prompts(tmp_path / "a.jsonl", 5)
    pyarrow = pytest.importorskip("pyarrow", reason="parquet eval datasets need pyarrow (a dev dependency)")
    import pyarrow.parquet as pq

    rows = [{"input": f"pq {i}", "answer": str(i), "metadata": {"rm_type": "length"}} for i in range(3)]
    pq.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "b.parquet")
    backend = Recording(stop_every=1_000_000)
    args = slime_args(
        eval_reward_key="acc",
        eval_datasets=[
            eval_config("sliced", f"{tmp_path / 'a.jsonl'}@[1:4]", custom_rm_path="tests.hooks.dict_rm", rm_type="f1"),
            eval_config("parquet", str(tmp_path / "b.parquet"), custom_rm_path="tests.hooks.dict_rm",
                        n_samples_per_eval_prompt=1, temperature=0.0, max_response_len=8, stop=["\n\n"]),
        ],
    )  # fmt: skip
    setattr(args, SERVICE_ATTRIBUTE, RolloutService(settings_from_args(args), env_args=args, backend=backend))
    try:
        out = generate_rollout(args, 3, DataSource(n_samples=2), evaluation=True)
    finally:
        getattr(args, SERVICE_ATTRIBUTE).shutdown()
    sliced, parquet = out.data["sliced"], out.data["parquet"]
    # rows 1..3 of five, two samples each, in slime's index order; prompts, labels, rm_type from the config
    assert [s.index for s in sliced["samples"]] == list(range(6))
    assert [s.prompt for s in sliced["samples"]] == [f"eval prompt {i}" for i in (1, 1, 2, 2, 3, 3)]
    assert all(s.metadata["rm_type"] == "f1" and s.label in "123" for s in sliced["samples"])
    assert [s.metadata["rm_type"] for s in parquet["samples"]] == ["length"] * 3  # the row's own
    # rewards: the dataset's reward function, its eval reward key picked out
    for data in (sliced, parquet):
        assert data["rewards"] == [hooks.length_reward(s) for s in data["samples"]]
        assert len(data["rewards"]) == len(data["truncated"]) == len(data["samples"])
    # each dataset's own sampling settings and budget reached the server
    by_temperature = {p.temperature: p for p in backend.params}
    assert set(by_temperature) == {0.5, 0.0}
    assert by_temperature[0.0].stop == ("\n\n",) and by_temperature[0.0].max_new_tokens <= 8
    assert all(s.response_length <= 8 and s.status.value == "truncated" for s in parquet["samples"])


def test_eval_dataset_settings_turnstile_cannot_honour_are_refused(tmp_path):
    write_prompts(tmp_path / "a.jsonl", 2)
    args = slime_args(
        eval_datasets=[eval_config("x", str(tmp_path / "a.jsonl"), custom_generate_function_path="my.gen")]
    )
    setattr(
        args, SERVICE_ATTRIBUTE, RolloutService(settings_from_args(args), env_args=args, backend=DeterministicBackend())
    )
    try:
        with pytest.raises(ValueError, match=re.escape("eval dataset 'x': custom_generate_function_path is set")):
            generate_rollout(args, 0, DataSource(n_samples=2), evaluation=True)
    finally:
        getattr(args, SERVICE_ATTRIBUTE).shutdown()


def test_the_http_clients_request_lines_stay_out_of_slimes_info_log():
    """slime logs at INFO; the HTTP client's line per request would be one line per turn in it (slime quiets its
    own httpx the same way)."""
    import logging

    import bridge.slime  # noqa: F401

    assert not logging.getLogger("httpx2").isEnabledFor(logging.INFO)
