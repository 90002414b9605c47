"""The one settings model: every knob declared once with one default and a description, read alike by the
engine, `turnstile run` (flags over YAML over defaults) and the slime bridge (slime's flags, then the
`turnstile:` section, then slime's suggestions); keys that are not knobs, or that slime's flags decide,
are refused with one error naming them; docs/settings.md is the model's table."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from bridge.flags import FLAGS, Handling
from bridge.settings import EMBEDDED_TURN_TOKENS, BridgeSettings, section, settings_from_args
from engine.backends.base import SamplingParams
from engine.cli import NOT_GIVEN, build_parser, main, settings_from_flags
from engine.config import (
    RETRY_FLAGS,
    EngineConfig,
    Flag,
    Only,
    Settings,
    Slime,
    markdown_table,
    marker,
)
from engine.scheduler.retry import RetryPolicy
from engine.turn import TurnLimits

ROOT = Path(__file__).resolve().parents[1]


def run_settings(*argv: str) -> Settings:
    return settings_from_flags(build_parser().parse_args(["run", *argv]))


# -- one declaration, one default, one description --------------------------------------------------------


def test_the_committed_doc_is_the_models_table():
    assert markdown_table() in (ROOT / "docs" / "settings.md").read_text(), "run: python -m engine.config"


def test_every_knob_is_declared_once_with_a_description():
    assert BridgeSettings.model_fields.keys() == Settings.model_fields.keys()  # the bridge adds no knob of its own
    assert EngineConfig.model_fields.keys() <= Settings.model_fields.keys()
    for name, field in [*Settings.model_fields.items(), *RetryPolicy.model_fields.items()]:
        assert field.description, f"{name} has no description"
    # the env step timeout exists once: in the retry policy, which the scheduler reads
    timeouts = [name for name in Settings.model_fields if "timeout" in name]
    assert timeouts == ["request_timeout_s"] and "env_step_timeout_s" in RetryPolicy.model_fields
    assert str(EMBEDDED_TURN_TOKENS) in Settings.model_fields["max_new_tokens"].description


def test_the_engine_the_cli_and_the_bridge_start_from_the_same_defaults():
    engine = EngineConfig()
    cli = run_settings().engine_config()
    bridge = settings_from_args(SimpleNamespace()).engine_config()  # no concurrency flag to fill from
    for knob in ("max_generating", "max_env_steps", "max_turns", "max_tokens", "policy", "max_staleness", "retry"):
        assert getattr(engine, knob) == getattr(cli, knob) == getattr(bridge, knob), knob
    assert engine.max_inflight == cli.max_inflight == 512
    assert (engine.max_generating, engine.max_env_steps, engine.retry.env_step_timeout_s) == (256, 64, 300.0)
    # no per-turn cap by default: a turn may use what is left of the budget (but the tiny local model's cap)
    assert engine.sampling.max_new_tokens == engine.max_tokens
    assert cli.sampling.max_new_tokens == bridge.sampling.max_new_tokens == EMBEDDED_TURN_TOKENS
    with_url = settings_from_args(SimpleNamespace(sglang_router_ip="10.0.0.1", sglang_router_port=3000))
    assert with_url.engine_config().sampling.max_new_tokens == with_url.max_tokens


# -- the engine's view ------------------------------------------------------------------------------------


def test_limits_and_sampling_objects_unpack_into_the_knobs_and_come_back_whole():
    sampling = SamplingParams(
        max_new_tokens=7, temperature=0.3, top_p=0.9, top_k=5, stop_token_ids=(1, 2), stop=("x",),
        skip_special_tokens=False, ignore_eos=True, min_new_tokens=2, repetition_penalty=1.1,
    )  # fmt: skip
    limits = TurnLimits(max_turns=3, max_tokens=99, max_context_len=500)
    config = EngineConfig(limits=limits, sampling=sampling)
    assert (config.limits, config.sampling) == (limits, sampling)  # every field is a knob: none is lost
    assert set(f.name for f in dataclasses.fields(SamplingParams)) - set(EngineConfig.model_fields) == {"sampling_seed"}
    with pytest.raises(ValueError, match="sampling and temperature both given"):
        EngineConfig(sampling=sampling, temperature=0.5)
    with pytest.raises(ValueError, match="sampling_seed_base"):
        EngineConfig(sampling=SamplingParams(max_new_tokens=4, sampling_seed=1))


def test_model_copy_is_validated_and_takes_limits_and_sampling():
    """The bridge's eval copies the engine's config with new limits and sampling."""
    config = EngineConfig(max_inflight=9, sampling=SamplingParams(max_new_tokens=24))
    copy = config.model_copy(
        update={"sampling": SamplingParams(max_new_tokens=64, temperature=0.0), "limits": TurnLimits(max_tokens=77)}
    )
    assert (copy.sampling.max_new_tokens, copy.sampling.temperature, copy.limits.max_tokens) == (64, 0.0, 77)
    assert copy.max_inflight == 9 and config.sampling.max_new_tokens == 24
    with pytest.raises(ValueError, match="max_env_steps"):
        config.model_copy(update={"max_env_steps": 0})


# -- turnstile run ----------------------------------------------------------------------------------------


def test_flags_override_the_yaml_which_overrides_the_defaults(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(
        "max_turns: 3\nrollout_interaction_env_path: my.env\nmax_generating: 9\n"
        "retry: {per_trajectory: 2, env_step_timeout_s: 50}\n"
    )
    settings = run_settings("--config", str(yaml_file), "--max-generating", "7", "--env-step-timeout", "5")
    assert (settings.max_turns, settings.env_path, settings.max_generating) == (3, "my.env", 7)
    assert (settings.retry.per_trajectory, settings.retry.env_step_timeout_s) == (2, 5.0)  # one retry key replaced
    assert settings.max_env_steps == Settings.model_fields["max_env_steps"].default


def test_every_flag_is_a_knob_with_its_description_and_no_default_of_its_own():
    parser = build_parser()
    run = parser._subparsers._group_actions[0].choices["run"]
    by_dest = {action.dest: action for action in run._actions}
    knobs = {name: field for name, field in Settings.model_fields.items() if marker(field, Flag)}
    knobs |= {flag.replace("-", "_"): RetryPolicy.model_fields[name] for name, flag in RETRY_FLAGS.items()}
    assert {"max_generating", "max_env_steps", "max_inflight", "env_step_timeout", "backend", "url"} <= knobs.keys()
    for dest, field in knobs.items():
        action = by_dest[dest]
        assert action.default is NOT_GIVEN and action.help.startswith(field.description.replace("%", "%%")), dest
    assert run_settings() == Settings()


def _value_flags() -> list[tuple[str, argparse.Action]]:
    """Every option of every `turnstile` command that takes a value, with its command."""
    commands = build_parser()._subparsers._group_actions[0].choices
    return [
        (command, action)
        for command, parser in commands.items()
        for action in parser._actions
        if action.option_strings and action.nargs != 0 and not isinstance(action, argparse._HelpAction)
    ]


def test_every_flag_whose_help_says_none_takes_none_and_no_other_flag_does():
    says_none, takes_none = set(), set()
    for command, action in _value_flags():
        flag = action.option_strings[-1]
        if re.search(r"\bnone\b", action.help or "", re.IGNORECASE):
            says_none.add(flag)
        try:
            args = build_parser().parse_args([command, flag, "none"])
        except SystemExit:
            continue
        if getattr(args, action.dest) is None:
            takes_none.add(flag)
            if command == "run":  # and the setting is None: not taken for a flag left out
                settings = settings_from_flags(args)
                retry = {dashed.replace("-", "_"): name for name, dashed in RETRY_FLAGS.items()}
                knob = settings.retry if action.dest in retry else settings
                assert getattr(knob, retry.get(action.dest, action.dest)) is None, flag
    assert {"--metrics-port", "--env-step-timeout", "--backend", "--max-new-tokens", "--url"} <= says_none
    assert takes_none == says_none


def test_a_flag_given_none_overrides_the_yaml(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("metrics_port: 9400\nbackend: local\nretry: {env_step_timeout_s: 50}\n")
    settings = run_settings(
        "--config", str(yaml_file), "--metrics-port", "none", "--backend", "none", "--env-step-timeout", "None"
    )
    assert (settings.metrics_port, settings.backend, settings.retry.env_step_timeout_s) == (None, None, None)
    assert run_settings("--config", str(yaml_file)).metrics_port == 9400


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("max_genrating: 9\n", "max_genrating: not a setting (did you mean max_generating?)"),
        ("ray_actor: x\n", "ray_actor: read under slime only"),
        ("env_step_timeout: 5\n", "env_step_timeout: now retry.env_step_timeout_s"),
        ("- a\n", "expected a mapping of settings, got list"),
    ],
)
def test_a_run_yaml_key_that_is_not_a_knob_is_one_error_naming_it(tmp_path, capsys, yaml_text, message):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(yaml_text)
    with pytest.raises(SystemExit) as exited:
        main(["run", "--config", str(yaml_file), "--out", str(tmp_path / "x")])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_backend_follows_the_url_and_vision_picks_the_tiny_vlm():
    assert run_settings().backend_kind == "local" and run_settings("--url", "http://h:1").backend_kind == "sglang"
    assert run_settings("--vision").local_model == "tiny-qwen2.5-vl"
    assert run_settings("--vision", "--model", "/my/vlm").local_model == "/my/vlm"
    with pytest.raises(ValueError, match="is for the sglang backend"):
        run_settings("--backend", "local", "--url", "http://h:1")


# -- the slime bridge -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("temperature", "turnstile.temperature: set by slime's `--rollout-temperature`"),
        ("max_turns", "set by slime's `max_turns:` at the top of the custom config"),
        ("rollout_interaction_env_path", "set by slime's `rollout_interaction_env_path:`"),
        ("env_step_timeout_s", "turnstile.env_step_timeout_s: now retry.env_step_timeout_s"),
        ("log_level", "read by `turnstile run` only"),
        ("max_env_step", "not a setting (did you mean max_env_steps?)"),
    ],
)
def test_a_section_key_slime_decides_or_that_is_not_a_knob_is_one_error_naming_it(key, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        settings_from_args(SimpleNamespace(turnstile={key: 1}))


def test_the_section_takes_every_knob_slime_does_not_decide():
    takes = {
        name for name, field in Settings.model_fields.items()
        if (marker(field, Only) or Only("slime")).reader == "slime"
        and (marker(field, Slime) is None or marker(field, Slime).fills)
    }  # fmt: skip
    assert {"max_generating", "max_env_steps", "retry", "max_restarts", "breaker_threshold", "ray_actor"} <= takes
    assert section(dict.fromkeys(takes, None)).keys() == takes


def test_slimes_flags_decide_the_section_wins_where_slime_only_suggests():
    args = SimpleNamespace(
        n_samples_per_prompt=4, rollout_batch_size=8, over_sampling_batch_size=16, partial_rollout=True,
        mask_offpolicy_in_partial_rollout=True, rollout_max_response_len=300, rollout_max_context_len=900,
        rollout_temperature=0.5, rollout_top_p=1.0, rollout_top_k=7, rollout_stop=["</a>"],
        rollout_stop_token_ids=[5], rollout_skip_special_tokens=True, rollout_seed=3,
        sglang_enable_deterministic_inference=True, hf_checkpoint="/ckpt", apply_chat_template_kwargs={"k": 1},
        sglang_router_ip="10.0.0.2", sglang_router_port=30000, sglang_server_concurrency=32, rollout_num_gpus=8,
        rollout_num_gpus_per_engine=2, max_turns=5, rollout_interaction_env_path="my.env",
        turnstile={"max_env_steps": 3, "retry": {"env_step_timeout_s": 30}},
    )  # fmt: skip
    s = settings_from_args(args)
    assert (s.n_samples_per_prompt, s.target_groups, s.partial_rollout, s.mask_offpolicy) == (4, 8, True, True)
    assert (s.max_tokens, s.max_context_len, s.max_turns, s.env_path) == (300, 900, 5, "my.env")
    assert (s.temperature, s.top_p, s.top_k, s.stop, s.stop_token_ids) == (0.5, 1.0, 7, ("</a>",), (5,))
    assert (s.skip_special_tokens, s.sampling_seed_base, s.tokenizer) == (True, 3, "/ckpt")
    assert (s.chat_template_kwargs, s.url, s.backend_kind, s.num_gpus) == (
        {"k": 1},
        "http://10.0.0.2:30000",
        "sglang",
        8,
    )
    # slime suggests: concurrency x engines, the over-sampling ratio, the groups in flight x n
    assert (s.max_generating, s.over_sampling, s.max_inflight) == (32 * 4, 2.0, 8 * 2 * 4)
    assert s.max_env_steps == 3 and s.retry.env_step_timeout_s == 30
    args.turnstile = {"max_generating": 5, "over_sampling": 1.25, "max_inflight": 6}
    s = settings_from_args(args)
    assert (s.max_generating, s.over_sampling, s.max_inflight) == (5, 1.25, 6)


def test_every_slime_flag_a_knob_names_is_one_the_flag_registry_honours_or_refuses():
    registry = {flag.option: flag for flag in FLAGS}
    named = {
        option
        for field in Settings.model_fields.values()
        if (source := marker(field, Slime)) is not None
        for option in re.findall(r"--[a-z0-9-]+", source.source)
    }
    assert "--rollout-max-response-len" in named
    for option in named:
        assert option in registry and registry[option].handling != Handling.SLIME, option


def test_the_embedded_default_caps_its_turns_and_an_explicit_cap_wins():
    embedded = BridgeSettings.embedded(2)
    assert (embedded.max_turns, embedded.max_tokens, embedded.sampling.max_new_tokens) == (4, 512, EMBEDDED_TURN_TOKENS)
    capped = settings_from_args(SimpleNamespace(turnstile={"max_new_tokens": 100}))
    assert capped.engine_config().sampling.max_new_tokens == 100
