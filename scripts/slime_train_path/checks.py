"""The checks of one rollout step and of one eval, each through slime's own functions.

A step goes as `RolloutManager.generate` takes it: `_get_rollout_data` (slime's call of the rollout
function, `validate_rollout_id_annotated`, the flattening), `log_rollout_data`'s computations,
`_convert_samples_to_train_data` (with `_post_process_rewards`), then `build_dp_schedule` and
`tensorize_rollout_data_for_training` as `_split_train_data_by_dp` calls them (its `ray.put` is not run).
"""

from __future__ import annotations

import itertools

from scripts.slime_train_path.common import Capture, Hung, call_with_timeout
from scripts.slime_train_path.eval_checks import EvalChecks
from scripts.slime_train_path.sample_checks import SampleChecks
from scripts.slime_train_path.train_checks import TrainChecks


class StepChecks(SampleChecks, TrainChecks, EvalChecks):
    """All checks of one run: `step` for each rollout step, `evaluation` for an eval."""

    def step(self, rollout_id: int) -> bool:
        """All checks of one step. False when the step produced nothing to check (the run stops)."""
        run, s, args = self.run, self.s, self.run.args
        name = f"step {rollout_id}"
        capture = Capture(s.load_function(args.rollout_function_path))
        run.manager.generate_rollout = capture
        s.set_current_rollout_id(rollout_id)  # as RolloutManager.generate does
        try:
            flat, metrics = call_with_timeout(run.manager._get_rollout_data, rollout_id, timeout=self.timeout)
            self.ok(
                f"{name}: generate_rollout via slime's _get_rollout_data",
                True,
                f"returned in {capture.seconds:.1f} s; call_rollout_fn, validate_rollout_id_annotated "
                "and the flattening passed",
            )
        except Hung as exc:
            run.hung = True
            self.report.error(run.name, f"{name}: generate_rollout", exc)
            return False
        except Exception as exc:
            if capture.out is None:
                self.report.error(run.name, f"{name}: generate_rollout", exc)
                return False
            self.report.error(run.name, f"{name}: slime's _get_rollout_data on the output", exc)
            out = capture.out
            nested = out.samples if isinstance(out, s.RolloutFnTrainOutput) else out
            flat, metrics = list(itertools.chain.from_iterable(nested or [])), getattr(out, "metrics", None)
        out = capture.out
        groups = out.samples if isinstance(out, s.RolloutFnTrainOutput) else out
        run.step_metrics.append(metrics or {})
        run.step_groups.append([g[0].group_index for g in groups if g] if isinstance(groups, list) else [])
        run.step_samples.append(list(flat or []))
        self.guard(name, "output shape", self.shape, name, out, groups)
        if not flat:
            return False
        self.guard(name, "samples", self.samples, name, groups, flat, rollout_id)
        self.guard(name, "rewards", self.rewards, name, groups, flat)
        self.guard(name, "slime's log_rollout_data", self.metrics, name, rollout_id, flat, metrics, capture.seconds)
        if run.rm_module is not None:
            self.guard(name, "plug-ins", self.plugins, name, groups, flat, metrics, rollout_id)
        self.guard(name, "training data", self.train_data, name, flat)
        if run.rm_module is not None:  # the plug-ins' records of this step
            for record in (run.rm_module.CALLS, run.rm_module.HOOKED, run.rm_module.FILTERED, run.rm_module.PROCESSED):
                record.clear()
        return True
