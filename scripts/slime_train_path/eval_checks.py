"""The checks of an eval: slime's `RolloutManager.eval` (the eval rollout, then `log_eval_rollout_data`)
on `args.eval_datasets` as slime's `build_eval_dataset_configs` built them."""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from typing import Any

from scripts.slime_train_path.common import Capture, Checks, Hung, call_with_timeout, counts, finite_number, problem_of


class EvalChecks(Checks):
    def evaluation(self, rollout_id: int) -> None:
        run, s, args = self.run, self.s, self.run.args
        name = f"eval {rollout_id}"
        configs = list(args.eval_datasets or [])
        self.ok(
            f"{name}: args.eval_datasets from slime's build_eval_dataset_configs",
            len(configs) == 1 and all(isinstance(c, s.EvalDatasetConfig) for c in configs),
            "; ".join(
                f"{c.name}: path ...{c.path[-20:]}, rm_type {c.rm_type}, n_samples_per_eval_prompt "
                f"{c.n_samples_per_eval_prompt}, input_key {c.input_key}, label_key {c.label_key}, "
                f"multimodal_keys {c.multimodal_keys}, apply_chat_template {c.apply_chat_template}"
                for c in configs
            ),
        )
        capture = Capture(s.load_function(args.eval_function_path))
        run.manager.eval_generate_rollout = capture
        run.log.calls.clear()
        try:
            call_with_timeout(run.manager.eval, rollout_id, timeout=self.timeout)
            self.ok(
                f"{name}: generate_rollout(evaluation=True) via slime's RolloutManager.eval",
                True,
                f"returned in {capture.seconds:.1f} s; log_eval_rollout_data ran",
            )
        except Hung as exc:
            run.hung = True
            self.report.error(run.name, f"{name}: generate_rollout(evaluation=True)", exc)
            return
        except Exception as exc:
            stage = "generate_rollout(evaluation=True)" if capture.out is None else "slime's log_eval_rollout_data"
            self.report.error(run.name, f"{name}: {stage}", exc)
            if capture.out is None:
                return
        out = capture.out
        data = out.data if isinstance(out, s.RolloutFnEvalOutput) else out
        names = sorted(data) if isinstance(data, dict) else []
        self.ok(
            f"{name}: output shape",
            isinstance(out, s.RolloutFnEvalOutput) and names == [c.name for c in configs],
            f"{type(out).__name__}, datasets {names} vs {[c.name for c in configs]}",
        )
        for cfg in configs:
            if cfg.name in names:
                self.guard(name, f"{cfg.name}", self.eval_dataset, name, cfg, data[cfg.name])
        logged = run.log.last()
        if not logged:
            return
        key = configs[0].name
        wanted = [f"eval/{key}", f"eval/{key}-truncated_ratio", f"eval/{key}/response_len/mean", "eval/step"]
        if args.log_passrate and args.n_samples_per_eval_prompt > 1:
            wanted.append(f"eval/{key}-pass@1")
        missing = [k for k in wanted if k not in logged]
        not_numbers = sorted(k for k, v in logged.items() if not finite_number(v))
        self.ok(
            f"{name}: slime's log_eval_rollout_data",
            not missing and not not_numbers,
            f"{len(logged)} metrics; eval/{key} {logged.get(f'eval/{key}')}, pass@1 "
            f"{logged.get(f'eval/{key}-pass@1')}; missing {missing or 'none'}; not finite numbers "
            f"{not_numbers[:6] or 'none'}",
        )

    def eval_dataset(self, name: str, cfg: Any, result: dict[str, Any]) -> None:
        run, s, args = self.run, self.s, self.run.args
        samples, rewards, truncated = (list(result.get(k) or []) for k in ("samples", "rewards", "truncated"))
        self.ok(
            f"{name}: {cfg.name} lists",
            len(samples) == len(rewards) == len(truncated) > 0,
            f"samples {len(samples)}, rewards {len(rewards)}, truncated {len(truncated)}",
        )
        try:
            dataset = run.eval_dataset(cfg)
        except Exception as exc:
            self.report.error(run.name, f"{name}: slime's Dataset on {cfg.path}", exc)
            return
        rows = {problem_of(x): x for x in dataset.samples}
        n = cfg.n_samples_per_eval_prompt or 1
        got = Counter(problem_of(x) for x in samples)
        self.ok(
            f"{name}: {cfg.name} slice {cfg.path.rsplit('@', 1)[-1]}",
            got == Counter({p: n for p in rows}),
            f"{len(samples)} samples vs {len(rows)} rows x n_samples_per_eval_prompt {n}; problems {dict(got)} "
            f"vs slime Dataset's {sorted(rows)}",
        )
        same = [
            x
            for x in samples
            if problem_of(x) in rows and rows[problem_of(x)].prompt == x.prompt and rows[problem_of(x)].label == x.label
        ]
        self.ok(
            f"{name}: {cfg.name} prompts and labels are slime Dataset's",
            len(same) == len(samples),
            f"{len(same)}/{len(samples)} equal the rendered text and label of their row",
        )

        async def score() -> list[Any]:
            out = []
            for x in samples:  # as eval_rollout_single_dataset prepares each sample before generate_and_rm
                y = copy.deepcopy(x)
                y.metadata = cfg.inject_metadata(getattr(y, "metadata", None))
                y.custom_rm_path = cfg.custom_rm_path
                out.append(await s.async_rm(args, y))
            return out

        try:
            expected = asyncio.run(score())
        except Exception as exc:
            self.report.error(run.name, f"{name}: slime's async_rm on the eval samples", exc)
            return
        key = args.eval_reward_key or args.reward_key
        values = [x.reward if not key else (x.reward or {}).get(key) for x in samples]
        mismatch = [(x.index, v, e) for x, v, e in zip(samples, values, expected, strict=True) if v != e]
        listed = list(rewards) == values
        self.ok(
            f"{name}: {cfg.name} rewards == slime's async_rm (rm_type {cfg.rm_type})",
            not mismatch and listed,
            f"{len(samples) - len(mismatch)}/{len(samples)} match; by value {counts(values)}; 'rewards' list "
            f"== sample rewards: {listed}; first mismatch (index, got, slime's): "
            f"{mismatch[0] if mismatch else 'none'}",
        )
        flags = [x.status == s.Sample.Status.TRUNCATED for x in samples]
        self.ok(
            f"{name}: {cfg.name} truncated flags",
            [bool(t) for t in truncated] == flags,
            f"{sum(flags)} truncated of {len(flags)}",
        )
