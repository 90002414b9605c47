"""The checks of rewards (slime's rm_hub, custom and group reward functions, the dynamic filter),
`log_rollout_data`'s metrics, and the training data: `_post_process_rewards`,
`_convert_samples_to_train_data`, `build_dp_schedule`, `tensorize_rollout_data_for_training`."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from scripts.slime_train_path.common import TRAIN_PARALLEL_CONFIG, Checks, counts, finite_number, reward_value

TRAIN_DATA_KEYS = (
    "tokens",
    "response_lengths",
    "rewards",
    "raw_reward",
    "truncated",
    "sample_indices",
    "rollout_ids",
    "loss_masks",
    "rollout_mask_sums",
    "rollout_log_probs",
)


class TrainChecks(Checks):
    def rewards(self, name: str, groups: list[list[Any]], flat: list[Any]) -> None:
        run, s, args = self.run, self.s, self.run.args
        Status = s.Sample.Status
        scored = [x for x in flat if x.status in (Status.COMPLETED, Status.TRUNCATED)]
        expected = self.expected_rewards(groups)
        mismatch = [(x.index, x.reward, expected.get(id(x))) for x in scored if x.reward != expected.get(id(x))]
        how = "batched_async_rm on each group (--group-rm)" if args.group_rm else "async_rm on each sample"
        via = f"--custom-rm-path {args.custom_rm_path}" if args.custom_rm_path else f"--rm-type {args.rm_type}"
        self.ok(
            f"{name}: rewards == slime's {how} ({via})",
            bool(scored) and not mismatch,
            f"{len(scored) - len(mismatch)}/{len(scored)} match (completed/truncated); rewards by "
            f"value {counts(x.reward for x in flat)}; first mismatch (index, got, slime's): "
            f"{mismatch[0] if mismatch else 'none'}",
        )
        if run.scripted:
            values = [reward_value(x, args) for x in flat]
            self.ok(
                f"{name}: rewards not all 0",
                any(v not in (0, None) for v in values),
                f"reward values (--reward-key {args.reward_key}) {counts(values)}",
            )
        if args.dynamic_sampling_filter_path:
            fn = s.load_function(args.dynamic_sampling_filter_path)
            dropped = [g[0].group_index for g in groups if not s.call_dynamic_filter(fn, args, g).keep]
            self.ok(
                f"{name}: returned groups pass the dynamic filter",
                not dropped,
                f"{args.dynamic_sampling_filter_path} keeps {len(groups) - len(dropped)}/{len(groups)}; "
                f"group_index of those it drops: {dropped or 'none'}",
            )
        if run.rm_module is not None and args.custom_rm_path:
            calls = list(run.rm_module.CALLS)
            if args.group_rm:
                whole = [
                    c
                    for c in calls
                    if c[0] == "group" and len(c[1]) == args.n_samples_per_prompt and len(set(c[1])) == 1
                ]
                returned = {g[0].group_index for g in groups}
                seen = {c[1][0] for c in whole}
                self.ok(
                    f"{name}: --group-rm scores whole groups",
                    len(whole) == len(calls) and returned <= seen,
                    f"{len(calls)} calls, {len(whole)} on one whole group of {args.n_samples_per_prompt}; "
                    f"returned groups scored: {len(returned & seen)}/{len(returned)}",
                )
            else:
                one = {c[1] for c in calls if c[0] == "one"}
                returned = {x.index for x in scored}
                self.ok(
                    f"{name}: --custom-rm-path called per sample",
                    returned <= one,
                    f"{len(calls)} calls; returned samples scored: {len(returned & one)}/{len(returned)}",
                )

    def plugins(self, name: str, groups: list[list[Any]], flat: list[Any], metrics: Any, rollout_id: int) -> None:
        """slime's rollout sample hooks (before the reward), --rollout-sample-filter-path (on the kept
        groups) and --rollout-all-samples-process-path (on kept and dropped groups, with the data source)."""
        run, args, module = self.run, self.run.args, self.run.rm_module
        returned = sorted(g[0].group_index for g in groups)
        if args.rollout_sample_hook_path:
            seen = {index: reward for index, _, reward in module.HOOKED}
            tagged = [x for x in flat if (x.metadata or {}).get("hooked_at") == rollout_id]
            early = [x for x in flat if x.index in seen and seen[x.index] is None]
            rm_after = [c for c in module.CALLS if c[0] == "one" and c[2]]
            rm_calls = [c for c in module.CALLS if c[0] == "one"]
            self.ok(
                f"{name}: --rollout-sample-hook-path runs before the reward",
                len(tagged) == len(early) == len(flat) and len(rm_after) == len(rm_calls),
                f"hook saw {len(seen)} samples; returned samples tagged with rollout_id {rollout_id}: "
                f"{len(tagged)}/{len(flat)}, hooked before their reward: {len(early)}/{len(flat)}; reward calls "
                f"after the hook: {len(rm_after)}/{len(rm_calls)}",
            )
        if args.rollout_sample_filter_path:
            flagged = [g[-1].remove_sample for g in groups]
            others = [x.remove_sample for g in groups for x in g[:-1]]
            calls = [sorted(c) for c in module.FILTERED]
            self.ok(
                f"{name}: --rollout-sample-filter-path on the returned groups",
                calls == [returned] and all(flagged) and not any(others),
                f"calls with groups {calls} vs returned {returned}; remove_sample set by it on "
                f"{sum(flagged)}/{len(flagged)} (the last of each group), on others {sum(others)}",
            )
        if args.rollout_all_samples_process_path:
            drops = sum(v for k, v in (metrics or {}).items() if k.startswith("rollout/dynamic_filter/drop_"))
            calls = module.PROCESSED
            seen = sorted(calls[0][0]) if len(calls) == 1 else []
            source = calls[0][1] if len(calls) == 1 else None
            self.ok(
                f"{name}: --rollout-all-samples-process-path on kept and dropped groups",
                len(calls) == 1
                and set(returned) <= set(seen)
                and len(seen) == len(returned) + drops
                and source == type(run.data_source).__name__,
                f"{len(calls)} call(s); groups {seen} = returned {returned} + {drops} dropped (metrics); data "
                f"source {source}",
            )

    def expected_rewards(self, groups: list[list[Any]]) -> dict[int, Any]:
        """slime's reward of each returned sample, computed again on a copy (by id of the sample)."""
        s, args, module = self.s, self.run.args, self.run.rm_module
        if module is not None:
            module.RECORDING[0] = False
        try:
            if args.group_rm:

                async def score_groups() -> list[list[Any]]:
                    return [await s.batched_async_rm(args, [copy.deepcopy(x) for x in g]) for g in groups]

                scores = asyncio.run(score_groups())
                return {id(x): r for g, rs in zip(groups, scores, strict=True) for x, r in zip(g, rs, strict=True)}

            async def score_samples() -> list[Any]:
                return [await s.async_rm(args, copy.deepcopy(x)) for g in groups for x in g]

            flat = [x for g in groups for x in g]
            return {id(x): r for x, r in zip(flat, asyncio.run(score_samples()), strict=True)}
        finally:
            if module is not None:
                module.RECORDING[0] = True

    # -- metrics and training data ---------------------------------------------------------------
    def metrics(self, name: str, rollout_id: int, flat: list[Any], metrics: Any, seconds: float) -> None:
        run, s, args = self.run, self.s, self.run.args
        run.log.calls.clear()
        try:
            s.log_rollout_data(rollout_id, args, flat, metrics, seconds)
        except Exception as exc:
            self.report.error(run.name, f"{name}: slime's log_rollout_data", exc)
            return
        logged = run.log.last()
        wanted = [
            "rollout/response_len/mean",
            "rollout/truncated_ratio",
            "rollout/repetition_frac",
            "perf/rollout_time",
            "perf/longest_sample_tokens_per_sec",
            "rollout/step",
        ]
        missing = [k for k in wanted if k not in logged]
        not_numbers = sorted(k for k, v in logged.items() if not finite_number(v))
        self.ok(
            f"{name}: slime's log_rollout_data",
            not missing and not not_numbers,
            f"{len(logged)} metrics ({len(metrics or {})} from the rollout function); response_len/mean "
            f"{logged.get('rollout/response_len/mean')}, zero_std "
            f"{ {k.split('/')[-1]: v for k, v in logged.items() if '/zero_std/' in k} }; missing {missing or 'none'}; "
            f"not finite numbers {not_numbers[:6] or 'none'}",
        )

    def train_data(self, name: str, flat: list[Any]) -> None:
        run, s, args = self.run, self.s, self.run.args
        manager = run.manager
        try:
            raw, normalized = manager._post_process_rewards(flat)
        except Exception as exc:
            self.report.error(run.name, f"{name}: slime's _post_process_rewards", exc)
            return
        size = args.n_samples_per_prompt * args.rollout_batch_size
        per_group: dict[Any, list[float]] = {}
        for x, r in zip(flat, normalized, strict=True):
            per_group.setdefault(x.group_index, []).append(r)
        centred = all(abs(sum(v) / len(v)) < 1e-5 for v in per_group.values())
        self.ok(
            f"{name}: slime's _post_process_rewards (GRPO group norm)",
            len(flat) == size and centred,
            f"{len(flat)} rewards vs n_samples_per_prompt x rollout_batch_size {size} (else slime normalises "
            f"over the whole batch); raw {counts(raw)}; per-group mean of normalised ~0: {centred}",
        )
        try:
            data = manager._convert_samples_to_train_data(flat)
        except Exception as exc:
            self.report.error(run.name, f"{name}: slime's _convert_samples_to_train_data", exc)
            return
        wanted = [*TRAIN_DATA_KEYS, "multimodal_train_inputs"]
        missing = [k for k in wanted if k not in data]
        self.ok(
            f"{name}: slime's _convert_samples_to_train_data",
            not missing,
            f"keys {sorted(data)}; missing {missing or 'none'}; rollout_mask_sums "
            f"{counts(data.get('rollout_mask_sums', []))}",
        )
        total_lengths = [len(t) for t in data["tokens"]]
        rollouts = len(set(data["rollout_ids"]))
        try:
            partitions, mbs, num_mbs, gbs = s.build_dp_schedule(
                args,
                TRAIN_PARALLEL_CONFIG,
                total_lengths,
                global_batch_size=args.global_batch_size,
                rollout_indices=data["rollout_ids"],
            )
        except Exception as exc:
            self.report.error(
                run.name,
                f"{name}: slime's build_dp_schedule (num_rollouts {rollouts} vs "
                f"global_batch_size {args.global_batch_size})",
                exc,
            )
            return
        placed = sorted(i for p in partitions for i in p)
        self.ok(
            f"{name}: slime's build_dp_schedule",
            placed == list(range(len(flat))),
            f"num_rollouts {rollouts} vs global_batch_size {args.global_batch_size}: {len(gbs)} train step(s), "
            f"dp {TRAIN_PARALLEL_CONFIG['dp_size']} x {num_mbs} microbatches; samples placed "
            f"{len(placed)}/{len(flat)}",
        )
        try:
            tensors = dict(data)
            s.tensorize_rollout_data_for_training(tensors)
            mm = next((m for m in tensors.get("multimodal_train_inputs") or [] if m), {})
            self.ok(
                f"{name}: slime's tensorize_rollout_data_for_training",
                True,
                f"tokens {tensors['tokens'][0].dtype} x {len(tensors['tokens'])}, loss_masks "
                f"{tensors['loss_masks'][0].dtype}, multimodal {sorted(mm)}",
            )
        except Exception as exc:
            self.report.error(run.name, f"{name}: slime's tensorize_rollout_data_for_training", exc)

    # -- eval ------------------------------------------------------------------------------------
