"""slime's rollout-related flags, and what Turnstile does with each: a registry, as data.

Every slime flag that bears on the rollout is honoured by Turnstile's rollout, or refused at start
with an error naming the flag and why; none is ignored in silence. Flags that slime acts on outside
the rollout function (its trainer, its RolloutManager, its data source, its loggers, its engine and
router launcher) are slime's side: Turnstile has nothing to do, and `how` says who in slime reads them.

Read from slime at `SLIME_COMMIT` (slime/utils/arguments.py, slime/backends/sglang_utils/arguments.py,
and sglang-router 0.3.2's `RouterArgs` for `--router-policy`). `default` is what slime's `args` holds
when the flag is not given, under slime's `dest`; `--rollout-batch-size` is required (no default).
`markdown_table()` renders the registry for docs/slime.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

SLIME_COMMIT = "624b824"


class Handling(StrEnum):
    HONOURED = "honoured"  # Turnstile's rollout does what slime's would with it
    REFUSED = "refused"  # set to anything but slime's default, start-up fails with `how`
    SLIME = "slime"  # slime acts on it outside the rollout function; Turnstile has nothing to do


@dataclass(frozen=True, slots=True)
class Flag:
    dest: str  # the attribute on slime's args, e.g. "rollout_top_p"
    option: str  # the command-line option, e.g. "--rollout-top-p"
    default: Any = field(hash=False)  # slime's default at SLIME_COMMIT (some are lists or dicts)
    handling: Handling
    how: str  # what Turnstile does with it / why it is refused / where slime reads it


_H, _R, _S = Handling.HONOURED, Handling.REFUSED, Handling.SLIME
_DATA = "slime/rollout/data_source.py:RolloutDataSource.__init__"  # slime's Dataset, built from args
_SCHED = "slime/utils/dp_schedule.py:build_dp_schedule"
_BUFFER_ROLLOUT = "Read only by slime_plugins/rollout_buffer's agent rollout, which Turnstile's rollout replaces."

# One entry per flag: dest, option, default, handling, how.
# fmt: off
FLAGS: tuple[Flag, ...] = (
    # -- add_rollout_arguments -------------------------------------------------------------------
    Flag("hf_checkpoint", "--hf-checkpoint", None, _H, "The tokenizer and the VLM processor are loaded from it."),
    Flag(
        "model_name", "--model-name", None, _S,
        "Trainer's HF weight naming: megatron_utils/actor.py:MegatronTrainRayActor.init.",
    ),
    Flag(
        "rollout_function_path", "--rollout-function-path", "slime.rollout.sglang_rollout.generate_rollout", _S,
        "slime/ray/rollout.py:RolloutManager.__init__ loads it; set it to bridge.slime.generate_rollout.",
    ),
    Flag("rollout_temperature", "--rollout-temperature", 1.0, _H, "The temperature of every turn's generate request."),
    Flag(
        "rollout_top_p", "--rollout-top-p", 1.0, _R,
        "Below 1, slime's trainer needs rollout_top_p_token_ids/offsets, which Turnstile does not produce.",
    ),
    Flag("rollout_top_k", "--rollout-top-k", -1, _H, "The top_k of every turn's generate request."),
    Flag(
        "rollout_max_context_len", "--rollout-max-context-len", None, _H,
        "Caps a trajectory's prompt + response tokens; each turn's max_new_tokens is cut to fit.",
    ),
    Flag(
        "rollout_max_prompt_len", "--rollout-max-prompt-len", None, _S,
        f"slime's Dataset drops longer prompts ({_DATA}).",
    ),
    Flag(
        "rollout_max_response_len", "--rollout-max-response-len", None, _H,
        "The whole response's budget (generated + observation tokens); each turn may use what is left.",
    ),
    Flag(
        "rollout_skip_special_tokens", "--rollout-skip-special-tokens", False, _H,
        "Sent with every generate request, and the env reads each turn's text decoded the same way.",
    ),
    Flag("rollout_stop", "--rollout-stop", None, _H, "Stop strings of every turn's generate request."),
    Flag(
        "rollout_stop_token_ids", "--rollout-stop-token-ids", None, _H,
        "Stop token ids of every turn, besides the chat template's end-of-turn ids.",
    ),
    Flag(
        "rollout_shuffle", "--rollout-shuffle", False, _S,
        "slime/rollout/data_source.py:RolloutDataSource.get_samples shuffles the prompts each epoch.",
    ),
    Flag(
        "rollout_seed", "--rollout-seed", 42, _H,
        "With deterministic inference, sampling_seed = rollout_seed + index in group; slime's Dataset shuffles by it.",
    ),
    Flag(
        "over_sampling_batch_size", "--over-sampling-batch-size", None, _H,
        "With partial rollout, over_sampling_batch_size / rollout_batch_size times the target groups stay in flight.",
    ),
    Flag(
        "dynamic_sampling_filter_path", "--dynamic-sampling-filter-path", None, _H,
        "Run on each finished group; drops counted as rollout/dynamic_filter/drop_*; a keep_when_insufficient "
        "group is dropped only within the step's over-sampling margin, as slime drops it only from one round.",
    ),
    Flag(
        "partial_rollout", "--partial-rollout", False, _H,
        "Unfinished trajectories stay paused in Turnstile's service, envs alive, and resume next step.",
    ),
    Flag(
        "mask_offpolicy_in_partial_rollout", "--mask-offpolicy-in-partial-rollout", False, _H,
        "A resumed trajectory's tokens from earlier steps get loss mask 0, as slime masks the earlier response.",
    ),
    Flag(
        "custom_generate_function_path", "--custom-generate-function-path", None, _R,
        "Only None or bridge.slime.generate: Turnstile's rollout calls no per-sample generate (envs: custom config).",
    ),
    Flag(
        "rollout_sample_hook_path", "--rollout-sample-hook-path", [], _H,
        "Each hook runs on every finished Sample before its reward, with rollout_id and evaluation, as slime.",
    ),
    Flag(
        "custom_rollout_log_function_path", "--custom-rollout-log-function-path", None, _S,
        "slime/observability/rollout_metrics.py:log_rollout_data calls it on the returned samples.",
    ),
    Flag(
        "custom_eval_rollout_log_function_path", "--custom-eval-rollout-log-function-path", None, _S,
        "slime/observability/rollout_metrics.py:log_eval_rollout_data calls it on the eval output.",
    ),
    Flag(
        "buffer_filter_path", "--buffer-filter-path", None, _R,
        "Turnstile keeps unfinished groups in its own service: slime's buffer, and so its filter, is never used.",
    ),
    Flag(
        "update_weight_buffer_size", "--update-weight-buffer-size", 512 * 1024**2, _S,
        "Chunk size of the trainer's weight sync: slime/backends/megatron_utils/update_weight/.",
    ),
    Flag(
        "update_weight_transport", "--update-weight-transport", "nccl", _H,
        "slime's trainer pushes weights to its engines this way. With no SGLang engine (--rollout-num-gpus 0), "
        "disk: each step first loads the newest weight_vNNNNNN of --update-weight-disk-dir into the embedded "
        "model; anything else leaves the embedded model's weights as they are (refused).",
    ),
    Flag(
        "update_weight_disk_dir", "--update-weight-disk-dir", None, _H,
        "Where the trainer writes weight_vNNNNNN: SGLang engines load it (sglang_utils), the embedded model too.",
    ),
    Flag(
        "update_weight_disk_keep_files", "--update-weight-disk-keep-files", False, _H,
        "With no SGLang engine, slime deletes each weight directory as soon as it is written (ray/actor_group.py) "
        "unless this is set; the embedded model loads them at the next step, so it is required there.",
    ),
    Flag(
        "update_weights_interval", "--update-weights-interval", 1, _S,
        "train.py:train and train_async.py:train push weights to the engines every N steps.",
    ),
    Flag(
        "keep_old_actor", "--keep-old-actor", False, _S,
        "Trainer: megatron_utils/actor.py:MegatronTrainRayActor.init keeps an old-actor copy.",
    ),
    Flag(
        "rollout_data_postprocess_path", "--rollout-data-postprocess-path", None, _S,
        "Trainer: megatron_utils/actor.py:MegatronTrainRayActor calls it on the train data after log-probs.",
    ),
    Flag(
        "rollout_data_transport", "--rollout-data-transport", "object-store", _S,
        "slime/ray/rollout.py:RolloutManager._split_train_data_by_dp ships the train data with it.",
    ),
    Flag(
        "rollout_external_engine_addrs", "--rollout-external-engine-addrs", None, _S,
        "sglang_utils/external.py registers these engines with slime's router, which Turnstile talks to.",
    ),
    # -- add_data_arguments ----------------------------------------------------------------------
    Flag("num_rollout", "--num-rollout", None, _S, "train.py:train runs this many steps."),
    Flag(
        "num_epoch", "--num-epoch", None, _S,
        "slime/ray/placement_group.py:create_rollout_manager turns it into num_rollout.",
    ),
    Flag(
        "rollout_global_dataset", "--disable-rollout-global-dataset", True, _R,
        "slime's own rollout asserts it; without it slime's data source hands out empty Samples.",
    ),
    Flag(
        "data_source_path", "--data-source-path", "slime.rollout.data_source.RolloutDataSourceWithBuffer", _S,
        "slime/ray/rollout.py:RolloutManager.__init__ builds it; Turnstile only calls its get_samples(n).",
    ),
    Flag("prompt_data", "--prompt-data", None, _S, f"slime's Dataset loads the prompts from it ({_DATA})."),
    Flag(
        "apply_chat_template", "--apply-chat-template", False, _H,
        "Prompts arrive rendered as text and are used as is; Turnstile renders the later turns.",
    ),
    Flag(
        "apply_chat_template_kwargs", "--apply-chat-template-kwargs", {}, _H,
        "Passed to the chat template for every observation too, as slime's Dataset did for the prompt.",
    ),
    Flag("input_key", "--input-key", "input", _S, f"slime's Dataset reads prompts by it ({_DATA})."),
    Flag("label_key", "--label-key", None, _S, f"slime's Dataset reads labels by it ({_DATA})."),
    Flag(
        "multimodal_keys", "--multimodal-keys", None, _S,
        "slime's Dataset loads images by it; Turnstile sends what lands in Sample.multimodal_inputs.",
    ),
    Flag("metadata_key", "--metadata-key", "metadata", _S, f"slime's Dataset fills Sample.metadata by it ({_DATA})."),
    Flag(
        "tool_key", "--tool-key", "tools", _H,
        "The tools slime's Dataset puts in metadata['tools'] are rendered in every observation.",
    ),
    Flag(
        "start_rollout_id", "--start-rollout-id", None, _S,
        "slime/ray/placement_group.py:create_training_models picks the first step from it.",
    ),
    Flag(
        "rollout_batch_size", "--rollout-batch-size", None, _H,
        "Required. Groups per step: generate_rollout returns exactly this many whole groups.",
    ),
    Flag(
        "n_samples_per_prompt", "--n-samples-per-prompt", 1, _H,
        "Samples per group: every returned group has exactly this many.",
    ),
    Flag(
        "global_batch_size", "--global-batch-size", None, _S,
        f"Trainer: {_SCHED} (needs as many distinct Sample.rollout_id).",
    ),
    Flag(
        "num_steps_per_rollout", "--num-steps-per-rollout", None, _S,
        "slime/utils/arguments.py:slime_validate_args derives global_batch_size from it.",
    ),
    Flag("micro_batch_size", "--micro-batch-size", 1, _S, f"Trainer: {_SCHED}."),
    Flag("balance_data", "--balance-data", False, _S, f"Trainer: {_SCHED} balances the DP ranks."),
    Flag("balance_by_flops", "--balance-by-flops", False, _S, f"Trainer: {_SCHED}."),
    Flag("use_dynamic_batch_size", "--use-dynamic-batch-size", False, _S, f"Trainer: {_SCHED}."),
    Flag("max_tokens_per_gpu", "--max-tokens-per-gpu", None, _S, f"Trainer: {_SCHED} packs micro-batches by it."),
    Flag(
        "log_probs_max_tokens_per_gpu", "--log-probs-max-tokens-per-gpu", None, _S,
        "Trainer-side; slime_validate_args defaults it to max_tokens_per_gpu.",
    ),
    # -- add_eval_arguments (slime resolves most into args.eval_datasets) ------------------------
    Flag(
        "eval_function_path", "--eval-function-path", None, _S,
        "slime/ray/rollout.py:RolloutManager.__init__ loads it (slime defaults it to rollout_function_path).",
    ),
    Flag("eval_interval", "--eval-interval", None, _S, "train.py:train runs eval every N steps."),
    Flag(
        "eval_prompt_data", "--eval-prompt-data", None, _H,
        "Resolved by slime into args.eval_datasets; the bridge runs each dataset through slime's Dataset loader.",
    ),
    Flag(
        "eval_config", "--eval-config", None, _H,
        "Resolved into args.eval_datasets: each dataset with its own sampling, n, rm_type, custom_rm_path.",
    ),
    Flag(
        "skip_eval_before_train", "--skip-eval-before-train", False, _S,
        "train.py:train skips the eval before step 0.",
    ),
    Flag("eval_input_key", "--eval-input-key", None, _H, "Resolved into each eval dataset's input_key."),
    Flag("eval_label_key", "--eval-label-key", None, _H, "Resolved into each eval dataset's label_key."),
    Flag(
        "eval_tool_key", "--eval-tool-key", None, _H,
        "Resolved into each eval dataset's tool_key; its tools are rendered in every observation.",
    ),
    Flag(
        "n_samples_per_eval_prompt", "--n-samples-per-eval-prompt", 1, _H,
        "Samples per eval prompt, unless the dataset sets its own.",
    ),
    Flag(
        "eval_temperature", "--eval-temperature", None, _H,
        "Resolved into each eval dataset's temperature (else rollout_temperature).",
    ),
    Flag(
        "eval_top_p", "--eval-top-p", None, _H,
        "Resolved into each eval dataset's top_p; eval samples never reach the trainer, so any value works.",
    ),
    Flag("eval_top_k", "--eval-top-k", None, _H, "Resolved into each eval dataset's top_k (else rollout_top_k)."),
    Flag(
        "eval_max_response_len", "--eval-max-response-len", None, _H,
        "Resolved into each eval dataset's max_response_len: an eval trajectory's response budget.",
    ),
    Flag(
        "eval_max_prompt_len", "--eval-max-prompt-len", None, _H,
        "max_length of slime's Dataset loader for eval prompts (longer ones dropped), as slime.",
    ),
    Flag(
        "eval_min_new_tokens", "--eval-min-new-tokens", None, _H,
        "Resolved into each eval dataset's min_new_tokens, sent with its generate requests.",
    ),
    Flag(
        "eval_max_context_len", "--eval-max-context-len", None, _H,
        "Caps eval trajectories' prompt + response; slime sets it to rollout_max_context_len when unset.",
    ),
    # -- add_reward_model_arguments --------------------------------------------------------------
    Flag(
        "rm_type", "--rm-type", None, _H,
        "slime's rm_hub rule (or metadata['rm_type']) scores every sample whose reward is None.",
    ),
    Flag(
        "reward_key", "--reward-key", None, _H,
        "Picks the value of a dict reward for filters and metrics, as Sample.get_reward_value.",
    ),
    Flag(
        "eval_reward_key", "--eval-reward-key", None, _H,
        "Eval 'rewards' take this key of a dict reward (slime defaults it to reward_key).",
    ),
    Flag("group_rm", "--group-rm", False, _H, "Each finished group is scored at once by rm_hub's batched_async_rm."),
    Flag("rm_url", "--rm-url", None, _H, "The service of rm_type remote_rm (and of slime's OPD teacher reward)."),
    Flag(
        "custom_rm_path", "--custom-rm-path", None, _H,
        "async fn(args, sample) (a group with group_rm) scores samples whose reward is None.",
    ),
    Flag(
        "custom_reward_post_process_path", "--custom-reward-post-process-path", None, _S,
        "slime/ray/rollout.py:RolloutManager._post_process_rewards calls it on the returned samples.",
    ),
    Flag(
        "custom_convert_samples_to_train_data_path", "--custom-convert-samples-to-train-data-path", None, _S,
        "Replaces slime/ray/rollout.py:RolloutManager._convert_samples_to_train_data.",
    ),
    # -- add_rollout_buffer_arguments ------------------------------------------------------------
    Flag("rollout_buffer_url", "--rollout-buffer-url", None, _R, _BUFFER_ROLLOUT),
    Flag("fetch_trajectory_retry_times", "--fetch-trajectory-retry-times", -1, _R, _BUFFER_ROLLOUT),
    Flag(
        "min_batch_collection_ratio", "--min-batch-collection-ratio", 1, _R,
        "Read by nothing in slime at 624b824 (a leftover of the rollout-buffer agent rollout).",
    ),
    Flag("rollout_task_type", "--rollout-task-type", "math", _R, _BUFFER_ROLLOUT),
    Flag(
        "loss_mask_type", "--loss-mask-type", "qwen", _S,
        "Only slime's sft and rollout-buffer rollouts read it; Turnstile's masks come from what it generated.",
    ),
    Flag(
        "data_pad_size_multiplier", "--data-pad-size-multiplier", 128, _S,
        "Trainer padding: slime/backends/megatron_utils/model.py:forward_step.",
    ),
    Flag(
        "rollout_sample_filter_path", "--rollout-sample-filter-path", None, _H,
        "Called on the step's returned groups (sets remove_sample), as slime does after the batch.",
    ),
    Flag(
        "rollout_all_samples_process_path", "--rollout-all-samples-process-path", None, _H,
        "Called with every finished group, kept or filtered, and the data source, as slime.",
    ),
    # -- the SGLang router and server flags slime adds or re-exposes -----------------------------
    Flag(
        "sglang_router_ip", "--sglang-router-ip", None, _H,
        "With the port: Turnstile's router; its workers are found through it (generation: see --router-policy).",
    ),
    Flag(
        "sglang_router_port", "--sglang-router-port", None, _H,
        "With the IP: requests carry X-SMG-Routing-Key, one key per trajectory.",
    ),
    Flag(
        "sglang_router_request_timeout_secs", "--sglang-router-request-timeout-secs", 14400, _S,
        "slime/ray/rollout.py:_start_router sets the router's request timeout.",
    ),
    Flag(
        "sglang_server_concurrency", "--sglang-server-concurrency", 512, _H,
        "Caps concurrent generate requests per engine (in all: this times the engines), like slime's semaphore.",
    ),
    Flag(
        "router_policy", "--router-policy", "cache_aware", _H,
        "consistent_hashing, manual: generation through the router, pinned by the routing key; others (cache_aware, "
        "the default) do not pin, so it goes to the router's workers, a trajectory kept on one (session_routing).",
    ),
    Flag(
        "sglang_enable_deterministic_inference", "--sglang-enable-deterministic-inference", False, _H,
        "Each request carries sampling_seed = rollout_seed + index in group (eval: + sample), as slime.",
    ),
    Flag(
        "sglang_dp_size", "--sglang-dp-size", 1, _S,
        "sglang_utils/sglang_engine.py:_compute_server_args; slime's rollout counts a dp rank it never sends.",
    ),
    Flag(
        "sglang_speculative_algorithm", "--sglang-speculative-algorithm", None, _H,
        "Each turn's spec_* counts from SGLang's meta_info are summed into Sample.spec_info, as slime does.",
    ),
    Flag(
        "sglang_tool_call_parser", "--sglang-tool-call-parser", None, _H,
        "Names the model family (engine/families.py): turn ends, stop tokens, the tool envs' parser. Any of SGLang's "
        "44: one the engine has no parser for is read by SGLang itself (/parse_function_call); not SGLang's: refused.",
    ),
    Flag(
        "sglang_reasoning_parser", "--sglang-reasoning-parser", None, _H,
        "qwen3-thinking / deepseek-r1: turns start inside the reasoning. Any of SGLang's: one the engine does not read "
        "is read by SGLang itself (/separate_reasoning); not SGLang's: refused.",
    ),
    Flag(
        "rollout_num_gpus", "--rollout-num-gpus", None, _H,
        "Divides Turnstile's per-GPU throughput metrics, as slime's perf/tokens_per_gpu_per_sec. 0 (without "
        "--rollout-external-engine-addrs): slime starts no SGLang engine, and Turnstile generates with the embedded "
        "local backend on the model at --hf-checkpoint.",
    ),
    Flag(
        "rollout_num_gpus_per_engine", "--rollout-num-gpus-per-engine", 1, _S,
        "slime's engine launcher (sglang_utils/sglang_engine.py); Turnstile counts engines through the router.",
    ),
    # -- add_algo_arguments and on-policy distillation (the rollout-facing ones) -----------------
    Flag(
        "use_rollout_routing_replay", "--use-rollout-routing-replay", False, _R,
        "Needs Sample.rollout_routed_experts (SGLang return_routed_experts), which Turnstile does not produce.",
    ),
    Flag(
        "use_rollout_logprobs", "--use-rollout-logprobs", False, _S,
        "Trainer (megatron_utils/loss.py) uses Sample.rollout_log_probs, which Turnstile fills for every token.",
    ),
    Flag(
        "use_rollout_entropy", "--use-rollout-entropy", False, _S,
        "Trainer: slime/backends/megatron_utils/model.py:forward_step computes the entropy.",
    ),
    Flag(
        "get_mismatch_metrics", "--get-mismatch-metrics", False, _S,
        "Trainer: megatron_utils/loss.py:policy_loss_function compares rollout_log_probs with its own.",
    ),
    Flag(
        "use_tis", "--use-tis", False, _S,
        "Trainer: megatron_utils/loss.py:policy_loss_function weights by rollout_log_probs.",
    ),
    Flag(
        "use_opd", "--use-opd", False, _S,
        "Trainer: megatron_utils/loss.py:compute_advantages_and_returns adds the teacher KL.",
    ),
    Flag(
        "opd_type", "--opd-type", None, _S,
        "Trainer and placement; 'sglang' gets teacher log-probs through custom_rm_path and reward post-process.",
    ),
    # -- add_ci_arguments, pre-parsed debug modes, --custom-config-path --------------------------
    Flag(
        "custom_config_path", "--custom-config-path", None, _H,
        "slime sets its keys on args; Turnstile reads max_turns, rollout_interaction_env_path and turnstile:.",
    ),
    Flag(
        "debug_rollout_only", "--debug-rollout-only", False, _S,
        "slime/ray/rollout.py:RolloutManager.generate stops before training; the rollout runs as usual.",
    ),
    Flag(
        "debug_train_only", "--debug-train-only", False, _S,
        "slime starts no SGLang engines (slime/ray/rollout.py:RolloutManager.__init__).",
    ),
    Flag(
        "load_debug_rollout_data", "--load-debug-rollout-data", None, _S,
        "slime/ray/rollout.py:RolloutManager._get_rollout_data loads saved samples instead of the rollout.",
    ),
    Flag(
        "ci_test", "--ci-test", False, _S,
        "slime's CI checks in RolloutManager and the trainer (slime's generate also asserts str prompts).",
    ),
    # -- add_wandb_arguments (rollout logging) ---------------------------------------------------
    Flag(
        "log_multi_turn", "--log-multi-turn", False, _S,
        "Trainer: train_metric_utils.py:log_multi_turn_data; Turnstile sets metadata['round_number'] (turns).",
    ),
    Flag(
        "log_passrate", "--log-passrate", False, _S,
        "slime/observability: train_metric_utils.py:log_passrate, rollout_metrics.py:log_eval_rollout_data.",
    ),
    Flag(
        "log_reward_category", "--log-reward-category", None, _S,
        "slime/observability/rollout_metrics.py:_compute_reward_cat_metrics reads reward[key].",
    ),
    Flag(
        "log_correct_samples", "--log-correct-samples", False, _S,
        "Trainer: slime/observability/train_metric_utils.py:log_rollout_data.",
    ),
)
# fmt: on


def markdown_table() -> str:
    """FLAGS as a GitHub markdown table, one row per flag, sorted by option (docs/slime.md holds it)."""
    rows = ["| option | handling | what Turnstile does |", "|---|---|---|"]
    for flag in sorted(FLAGS, key=lambda f: f.option):
        how = flag.how.replace("|", "\\|")
        rows.append(f"| `{flag.option}` | {flag.handling.value} | {how} |")
    return "\n".join(rows) + "\n"


# -- checks at start (below) --

ALLOWED = {"custom_generate_function_path": ("bridge.slime.generate",)}  # refused flags' accepted values


class FlagError(ValueError):
    """slime flags set that Turnstile's rollout cannot honour; the message names each and why."""


def refused(args: Any) -> list[str]:
    """One line per refused flag that `args` sets to anything but slime's default (or an allowed value)."""
    lines = []
    for flag in FLAGS:
        if flag.handling is not Handling.REFUSED or not hasattr(args, flag.dest):
            continue
        value = getattr(args, flag.dest)
        if value != flag.default and value not in ALLOWED.get(flag.dest, ()):
            lines.append(f"{flag.option} {value!r}: {flag.how}")
    return lines


def slime_starts_no_engines(args: Any) -> bool:
    """`--rollout-num-gpus 0` without `--rollout-external-engine-addrs`: slime starts its router but no SGLang engine
    (slime/ray/rollout.py `_resolve_sglang_config`), so the bridge generates with the embedded local backend,
    on the model at `--hf-checkpoint`."""
    return (
        args is not None
        and getattr(args, "rollout_num_gpus", None) == 0
        and not getattr(args, "rollout_external", False)
    )


def weights_by_disk(args: Any) -> bool:
    """slime's trainer writes every weight version whole to `--update-weight-disk-dir`."""
    transport, mode = getattr(args, "update_weight_transport", "nccl"), getattr(args, "update_weight_mode", "full")
    return (transport, mode) == ("disk", "full")


def embedded_weight_updates(args: Any) -> list[str]:
    """With no SGLang engine (--rollout-num-gpus 0) the embedded model takes slime's weights from disk: a
    line for each flag that would leave it on its first weights without a word."""
    if not slime_starts_no_engines(args):
        return []
    if getattr(args, "debug_rollout_only", False) or getattr(args, "debug_train_only", False):
        return []
    if not weights_by_disk(args):
        transport, mode = getattr(args, "update_weight_transport", "nccl"), getattr(args, "update_weight_mode", "full")
        return [
            f"--update-weight-transport {transport!r} --update-weight-mode {mode!r}: with --rollout-num-gpus 0 "
            "the embedded model takes the trainer's weights only by disk (--update-weight-transport disk "
            "--update-weight-mode full --update-weight-disk-dir DIR --update-weight-disk-keep-files)"
        ]
    if not getattr(args, "update_weight_disk_keep_files", False):
        return [
            "--update-weight-disk-keep-files is not set: with --rollout-num-gpus 0 slime deletes each weight "
            "directory as soon as the trainer writes it, before the embedded model can load it"
        ]
    return []


def check_args(args: Any) -> None:
    """Refuse at start, in one error, every slime flag set that Turnstile's rollout cannot honour."""
    lines = refused(args) + embedded_weight_updates(args)
    if lines:
        raise FlagError("Turnstile's rollout cannot run with these slime flags:\n  " + "\n  ".join(lines))


if __name__ == "__main__":  # docs/slime.md's table: python -m bridge.flags
    print(markdown_table(), end="")
