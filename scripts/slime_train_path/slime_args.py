"""slime's `args` for a run, from slime's own parser where it runs with the stubs.

slime's `parse_args` is, in order: `_pre_parse_mode()`, `sglang_parse_args()`, Megatron's parser extended
by `get_slime_extra_args_provider()`, then `slime_validate_args`, Megatron's and SGLang's validation. All
of it is run here from the checkout (with `sys.argv` set to the run's flags) except Megatron's parser and
validation (Megatron is not installable here: a plain ArgumentParser takes slime's flags instead, and the
few Megatron-owned attributes slime's rollout path reads, e.g. --micro-batch-size and --global-batch-size,
are among the ones slime's provider re-declares) and SGLang's `validate_args` (it reads SGLang's server
flags, which the ServerArgs stub does not add).

When slime's parser does not run, a Namespace of slime's defaults (read from slime/utils/arguments.py at
624b824) for exactly the attributes the functions run here read is used instead; the runner says which.
"""

from __future__ import annotations

import argparse
import json
import sys
from argparse import Namespace
from typing import Any


def to_argv(settings: dict[str, Any]) -> list[str]:
    """{"rollout_batch_size": 2, "apply_chat_template": True, "multimodal_keys": {...}} -> slime's flags."""
    argv: list[str] = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        elif isinstance(value, list | tuple):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def build(settings: dict[str, Any]) -> tuple[Namespace, str]:
    """(args, how they were built)."""
    try:
        return parse(to_argv(settings)), "slime's parser (slime_validate_args run)"
    except SystemExit as exc:  # argparse refused a flag: the settings are wrong, not slime's parser
        raise ValueError(f"slime's parser refused {to_argv(settings)} (exit {exc.code})") from exc
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
        return fallback(settings), f"fallback Namespace of slime's 624b824 defaults (slime's parser failed: {why})"


def parse(argv: list[str]) -> Namespace:
    from slime.backends.sglang_utils.arguments import sglang_parse_args
    from slime.utils import arguments as slime_arguments

    saved, sys.argv = sys.argv, ["train.py", *argv]
    try:
        pre = slime_arguments._pre_parse_mode()
        sglang_ns = sglang_parse_args()
        parser = argparse.ArgumentParser(allow_abbrev=False)
        slime_arguments.get_slime_extra_args_provider()(parser)
        args, unknown = parser.parse_known_args(argv)  # Megatron's parser ignores unknown flags too
    finally:
        sys.argv = saved
    unknown = [a for a in unknown if a.startswith("--") and not hasattr(sglang_ns, a[2:].replace("-", "_"))]
    if unknown:
        raise ValueError(f"flags no parser of slime's knows: {unknown}")
    for key, value in {**vars(pre), **vars(sglang_ns)}.items():
        setattr(args, key, value)
    slime_arguments.slime_validate_args(args)
    return args


# slime's defaults at 624b824 (slime/utils/arguments.py) for the attributes read on the path run here
DEFAULTS: dict[str, Any] = {
    "advantage_estimator": "grpo",
    "apply_chat_template": False,
    "apply_chat_template_kwargs": {},
    "balance_by_flops": False,
    "balance_data": False,
    "buffer_filter_path": None,
    "ci_test": False,
    "custom_convert_samples_to_train_data_path": None,
    "custom_eval_rollout_log_function_path": None,
    "custom_reward_post_process_path": None,
    "custom_rm_path": None,
    "custom_rollout_log_function_path": None,
    "custom_generate_function_path": None,
    "data_source_path": "slime.rollout.data_source.RolloutDataSourceWithBuffer",
    "debug_rollout_only": False,
    "debug_train_only": False,
    "dump_details": None,
    "eval_function_path": None,
    "global_batch_size": None,
    "grpo_std_normalization": True,
    "group_rm": False,
    "hf_checkpoint": None,
    "input_key": "input",
    "label_key": None,
    "load_debug_rollout_data": None,
    "log_passrate": False,
    "log_reward_category": None,
    "max_tokens_per_gpu": None,
    "metadata_key": "metadata",
    "micro_batch_size": 1,
    "multimodal_keys": None,
    "n_samples_per_eval_prompt": 1,
    "n_samples_per_prompt": 1,
    "prompt_data": None,
    "reward_key": None,
    "eval_reward_key": None,
    "rewards_normalization": True,
    "rm_type": None,
    "rm_url": None,
    "rollout_batch_size": None,
    "rollout_function_path": "slime.rollout.sglang_rollout.generate_rollout",
    "rollout_global_dataset": True,
    "rollout_max_prompt_len": None,
    "rollout_num_gpus": None,
    "rollout_seed": 42,
    "rollout_shuffle": False,
    "save": None,
    "save_debug_rollout_data": None,
    "sglang_router_ip": None,
    "sglang_router_port": None,
    "tool_key": "tools",
    "use_dynamic_batch_size": False,
    "use_fault_tolerance": False,
    "wandb_always_use_train_step": False,
    "use_wandb": False,
    "use_tensorboard": False,
    "dynamic_sampling_filter_path": None,
    "rollout_sample_filter_path": None,
    "rollout_all_samples_process_path": None,
    "rollout_sample_hook_path": [],
    "over_sampling_batch_size": None,
    "partial_rollout": False,
    "mask_offpolicy_in_partial_rollout": False,
    "rollout_max_response_len": None,
    "rollout_max_context_len": None,
    "rollout_temperature": 1.0,
    "rollout_top_p": 1.0,
    "rollout_top_k": -1,
    "rollout_stop": None,
    "rollout_stop_token_ids": None,
    "rollout_skip_special_tokens": False,
    "eval_config": None,
    "eval_prompt_data": None,
    "eval_input_key": None,
    "eval_label_key": None,
    "eval_tool_key": None,
    "eval_temperature": None,
    "eval_top_p": None,
    "eval_top_k": None,
    "eval_max_response_len": None,
    "eval_min_new_tokens": None,
    "eval_max_prompt_len": None,
    "eval_max_context_len": None,
    "num_rollout": None,
    "use_rollout_routing_replay": False,
    "sglang_server_concurrency": 512,
    "custom_config_path": None,
}


def fallback(settings: dict[str, Any]) -> Namespace:
    """slime's defaults, the run's settings, and the parts of slime_validate_args this path depends on."""
    import yaml

    args = Namespace(**{**DEFAULTS, **settings})
    if isinstance(args.rollout_sample_hook_path, str):  # an append flag: a list of paths
        args.rollout_sample_hook_path = [args.rollout_sample_hook_path]
    if args.n_samples_per_prompt == 1:
        args.grpo_std_normalization = False
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = args.rollout_batch_size
    if args.eval_function_path is None:
        args.eval_function_path = args.rollout_function_path
    if args.eval_reward_key is None:
        args.eval_reward_key = args.reward_key
    if args.custom_config_path:
        with open(args.custom_config_path) as f:
            for key, value in (yaml.safe_load(f) or {}).items():
                setattr(args, key, value)
    args.eval_datasets = []
    if args.eval_config:
        from omegaconf import OmegaConf
        from slime.utils.eval_config import build_eval_dataset_configs, ensure_dataset_list

        eval_cfg = OmegaConf.to_container(OmegaConf.load(args.eval_config), resolve=True)
        eval_cfg = eval_cfg.get("eval", eval_cfg)
        args.eval_datasets = build_eval_dataset_configs(
            args, ensure_dataset_list(eval_cfg.get("datasets")), dict(eval_cfg.get("defaults") or {})
        )
    return args
