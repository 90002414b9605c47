"""Proves with slime's own code that what `bridge.slime.generate_rollout` returns can be trained on.

    scripts/slime_train_path.sh /path/to/slime [--slime-commit SHA] [--runs NAME,...] [--step-timeout S]
                                [--rollout-function-path PKG.MOD.FN] [--keep-tmp]

Everything slime does with a rollout function's output runs from the checkout (imported, never copied):
its argument parser and `slime_validate_args` for `args`; `RolloutDataSourceWithBuffer` and its Dataset
over JSONL and parquet prompts with images and `--apply-chat-template`; slime's geo3k multi-turn env; its
rewards (`async_rm` / `batched_async_rm`: `--rm-type math`, `--custom-rm-path`, `--group-rm`,
`--reward-key`), the dynamic filter and the rollout sample plug-ins; `RolloutManager`'s
`_get_rollout_data`, `_post_process_rewards`, `_convert_samples_to_train_data` and `eval`;
`build_dp_schedule`, `tensorize_rollout_data_for_training`; `log_rollout_data` / `log_eval_rollout_data`.

One line per check, PASS or FAIL with its figure, then a summary; the exit status is 1 when any check
fails. Modules: stubs (what is stubbed and why), slime_args (slime's parser, or a Namespace of its
defaults), fixtures (the temp-dir files), double (the scripted SGLang server), checks with sample_checks,
train_checks and eval_checks, report, example (the run `example/geo3k`: examples/geo3k_vlm_multi_turn's run.sh
flags and turnstile.yaml as written, only the scale overridden, with partial rollout), main (the runs).
"""
