"""The runs: the embedded default (tiny Qwen2.5-VL in process) on slime's data source over JSONL and
parquet prompts, with an eval; then a scripted SGLang server for the reward paths: --rm-type math with
the dynamic filter, --rollout-all-samples-process-path and an eval; --custom-rm-path with a rollout
sample hook and --rollout-sample-filter-path; --group-rm with --reward-key; and examples/geo3k_vlm_multi_turn
as written (its run.sh's flags, its turnstile.yaml, partial rollout over 3 steps; example.py). Every run builds
slime's args (slime_args.py), slime's data source and a RolloutManager made without `__init__`, then checks
each step and the eval (checks.py)."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[2]

RUN_NAMES = (
    "embedded/jsonl",
    "embedded/parquet",
    "scripted/math+filter+eval",
    "scripted/custom-rm+hooks",
    "scripted/group-rm+reward-key",
    "example/geo3k",
)
EXAMPLE_RUN = "example/geo3k"  # examples/geo3k_vlm_multi_turn as written (example.py)


@dataclass
class Run:
    name: str
    settings: dict[str, Any]
    steps: int
    evaluate: bool = False
    scripted: bool = False
    slime: Any = None
    rm_module: Any = None
    server: Any = None
    args: Any = None
    data_source: Any = None
    manager: Any = None
    tokenizer: Any = None
    processor: Any = None
    log: Any = None
    rendered: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    step_metrics: list[dict[str, Any]] = field(default_factory=list)
    step_groups: list[list[Any]] = field(default_factory=list)  # group_index of the groups each step returned
    step_samples: list[list[Any]] = field(default_factory=list)  # the Samples each step returned
    hung: bool = False
    example: Any = None  # example.Example: what the run took from examples/geo3k_vlm_multi_turn, and changed
    note: str = ""  # printed on the ARGS line

    def eval_dataset(self, cfg: Any) -> Any:
        """slime's Dataset for an eval config, with the settings eval_rollout_single_dataset gives it."""
        args, pick = self.args, lambda value, default: default if value is None else value
        return self.slime.Dataset(
            path=cfg.path,
            tokenizer=self.tokenizer,
            processor=self.processor,
            max_length=args.eval_max_prompt_len,
            prompt_key=cfg.input_key,
            label_key=cfg.label_key,
            multimodal_keys=pick(cfg.multimodal_keys, args.multimodal_keys),
            metadata_key=cfg.metadata_key,
            tool_key=cfg.tool_key,
            apply_chat_template=pick(cfg.apply_chat_template, args.apply_chat_template),
            apply_chat_template_kwargs=pick(cfg.apply_chat_template_kwargs, args.apply_chat_template_kwargs),
        )


def cli(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/slime_train_path.sh", description=__doc__)
    parser.add_argument("slime", type=Path, help="a slime checkout (THUDM/slime)")
    parser.add_argument(
        "--slime-commit",
        default=os.environ.get("SLIME_COMMIT"),
        help="the checkout's commit when it is not a git repo (default: $SLIME_COMMIT)",
    )
    parser.add_argument("--runs", default=",".join(RUN_NAMES), help=f"comma-separated subset of {RUN_NAMES}")
    parser.add_argument(
        "--rollout-function-path",
        default="bridge.slime.generate_rollout",
        help="the rollout function under test (slime's --rollout-function-path)",
    )
    parser.add_argument("--step-timeout", type=float, default=300.0, help="seconds one rollout call may take")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the temp dir of fixtures")
    return parser.parse_args(argv)


def slime_commit(root: Path, given: str | None) -> str:
    if (root / ".git").exists():
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        if done.returncode == 0:
            return f"{done.stdout.strip()} (git)"
    return f"{given} (given)" if given else "unknown (not a git repo; pass --slime-commit or set SLIME_COMMIT)"


def import_slime() -> SimpleNamespace:
    """The functions of the checkout this script runs (never copies)."""
    from slime.observability import rollout_data_utils, rollout_metrics
    from slime.ray.rollout import RolloutManager
    from slime.rollout import base_types, rm_hub, sample_hooks
    from slime.rollout.filter_hub import base_types as filter_types
    from slime.utils import data, dp_schedule, eval_config, misc, processing_utils, types

    return SimpleNamespace(
        Sample=types.Sample,
        RolloutFnTrainOutput=base_types.RolloutFnTrainOutput,
        RolloutFnEvalOutput=base_types.RolloutFnEvalOutput,
        async_rm=rm_hub.async_rm,
        batched_async_rm=rm_hub.batched_async_rm,
        call_dynamic_filter=filter_types.call_dynamic_filter,
        set_current_rollout_id=sample_hooks.set_current_rollout_id,
        validate_rollout_id_annotated=rollout_data_utils.validate_rollout_id_annotated,
        tensorize_rollout_data_for_training=rollout_data_utils.tensorize_rollout_data_for_training,
        log_rollout_data=rollout_metrics.log_rollout_data,
        log_eval_rollout_data=rollout_metrics.log_eval_rollout_data,
        build_dp_schedule=dp_schedule.build_dp_schedule,
        EvalDatasetConfig=eval_config.EvalDatasetConfig,
        Dataset=data.Dataset,
        load_function=misc.load_function,
        build_processor_kwargs=processing_utils.build_processor_kwargs,
        load_tokenizer=processing_utils.load_tokenizer,
        load_processor=processing_utils.load_processor,
        # RolloutManager is a @ray.remote class: the plain class is the ActorClass's __ray_actor_class__
        RolloutManagerClass=getattr(RolloutManager, "__ray_actor_class__", RolloutManager),
    )


def make_manager(s: SimpleNamespace, args: Any, data_source: Any) -> Any:
    """A RolloutManager without `__init__` (no Ray actor, no SGLang servers): the attributes `__init__`
    sets that the post-processing and eval methods read."""
    from scripts.slime_train_path.common import TRAIN_PARALLEL_CONFIG

    cls = s.RolloutManagerClass
    manager = cls.__new__(cls)
    manager.args, manager.data_source, manager.servers, manager.rollout_id = args, data_source, {}, -1
    manager._health_monitors = []
    manager.generate_rollout = s.load_function(args.rollout_function_path)
    manager.eval_generate_rollout = s.load_function(args.eval_function_path)
    manager.custom_reward_post_process_func = (
        s.load_function(args.custom_reward_post_process_path) if args.custom_reward_post_process_path else None
    )
    manager.custom_convert_samples_to_train_data_func = (
        s.load_function(args.custom_convert_samples_to_train_data_path)
        if args.custom_convert_samples_to_train_data_path
        else None
    )
    manager.set_train_parallel_config(TRAIN_PARALLEL_CONFIG)
    return manager


def execute(run: Run, report: Any, timeout: float) -> None:
    from scripts.slime_train_path import slime_args
    from scripts.slime_train_path.checks import StepChecks
    from scripts.slime_train_path.common import problem_of

    s = run.slime
    try:
        run.args, how = slime_args.build(run.settings)
    except Exception as exc:
        report.error(run.name, "slime args", exc)
        return
    args = run.args
    print(
        f"ARGS  [{run.name}] built by {how}; max_turns {getattr(args, 'max_turns', None)}, env "
        f"{getattr(args, 'rollout_interaction_env_path', None)}, turnstile {getattr(args, 'turnstile', None)}"
        + (f"; {run.note}" if run.note else ""),
        flush=True,
    )
    report.check(
        run.name,
        "GRPO settings",
        (args.advantage_estimator, args.rewards_normalization, args.grpo_std_normalization) == ("grpo", True, True)
        and args.global_batch_size == args.rollout_batch_size * args.n_samples_per_prompt,
        f"advantage_estimator {args.advantage_estimator}, rewards_normalization {args.rewards_normalization}, "
        f"grpo_std_normalization {args.grpo_std_normalization}, global_batch_size {args.global_batch_size} "
        f"= rollout_batch_size {args.rollout_batch_size} x n_samples_per_prompt {args.n_samples_per_prompt}",
    )
    try:  # as RolloutManager.__init__ does
        run.data_source = s.load_function(args.data_source_path)(args)
    except Exception as exc:
        report.error(run.name, f"slime's data source {args.data_source_path}", exc)
        return
    rows = list(run.data_source.dataset.samples)
    run.rendered = {problem_of(x): (x.prompt, x.label) for x in rows}
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    report.check(
        run.name,
        f"slime's Dataset built the Samples ({Path(args.prompt_data).suffix[1:]})",
        bool(rows)
        and all(
            isinstance(x.prompt, str) and vision in x.prompt and (x.multimodal_inputs or {}).get("images") for x in rows
        ),
        f"{len(rows)} rows, prompts rendered by the chat template with one image each (e.g. {rows[0].prompt[-120:]!r})"
        if rows
        else "no rows",
    )
    run.manager = make_manager(s, args, run.data_source)
    checks = StepChecks(report, run, timeout)
    partial = None
    if args.partial_rollout:
        from scripts.slime_train_path.example import PartialRolloutChecks

        partial = PartialRolloutChecks(report, run)
    for step in range(run.steps):
        if not checks.step(step):
            break
        if partial is not None:
            partial.after_step(step)
    if partial is not None and not run.hung:
        partial.finish()
    if run.example is not None and not run.hung:
        from scripts.slime_train_path.example import final_checks

        final_checks(run, report, run.example)
    if args.dynamic_sampling_filter_path and run.step_metrics:
        drops = {k: v for m in run.step_metrics for k, v in m.items() if k.startswith("rollout/dynamic_filter/drop_")}
        report.check(
            run.name,
            "dynamic filter drops in the returned metrics",
            sum(drops.values()) >= 2,
            f"{drops or 'no rollout/dynamic_filter/drop_* key'} over {len(run.step_metrics)} step(s); the "
            "script makes G1 all right and G2 all wrong (zero std), both in the first step's prompts",
        )
    if run.server is not None:
        server = run.server
        report.check(
            run.name,
            "scripted SGLang server understood every request",
            not server.errors,
            f"{len(server.replies)} replies, first turns per problem {dict(server.first_turns)}; "
            f"errors {server.errors[:2] or 'none'}",
        )
    if run.evaluate and not run.hung:
        checks.evaluation(run.steps - 1)


def main(argv: list[str] | None = None) -> int:
    opts = cli(argv)
    root = opts.slime.resolve()
    if not (root / "slime" / "rollout").is_dir():
        print(f"{root} is not a slime checkout (no slime/rollout/)", file=sys.stderr)
        return 2
    from scripts.slime_train_path import fixtures, report, stubs

    report.SLIME_ROOT = root
    sys.path[:] = [str(REPO), str(root), *[p for p in sys.path if p not in (str(REPO), str(root))]]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print(f"slime checkout {root}, commit {slime_commit(root, opts.slime_commit)}")
    print(f"turnstile {REPO} at HEAD {head.stdout.strip() or '?'} (working tree as it is now)")
    for module, why in stubs.install():
        print(f"STUB  {module}: {why}")
    results = report.Report()
    try:
        s = import_slime()
    except Exception as exc:
        results.error("setup", "import slime's modules from the checkout", exc)
        return 1
    log = stubs.patch_log()
    print(
        "PATCH slime.observability.logging_utils.log: records the metrics log_rollout_data and "
        "log_eval_rollout_data would send to wandb/tensorboard (their computations run unchanged)"
    )
    import examples.geo3k_vlm_multi_turn.env_geo3k as env_module

    results.check(
        "setup",
        "slime's geo3k env from the checkout",
        Path(env_module.__file__).is_relative_to(root),
        f"examples.geo3k_vlm_multi_turn.env_geo3k is {env_module.__file__}",
    )

    tmp = Path(tempfile.mkdtemp(prefix="slime_train_path-"))
    sys.path.insert(0, str(tmp))  # the reward module for --custom-rm-path
    started = time.monotonic()
    try:
        prompts = fixtures.write_prompts(tmp)
        hf = fixtures.write_hf_checkpoint(tmp)
        rm_module = importlib.import_module(fixtures.write_rm_module(tmp))
        tokenizer = s.load_tokenizer(str(hf), trust_remote_code=True)
        processor = s.load_processor(str(hf), trust_remote_code=True)
    except Exception as exc:
        results.error("setup", f"fixtures in {tmp}", exc)
        return 1
    turnstile = {"vision": True, "max_new_tokens": 32}
    base = dict(
        hf_checkpoint=str(hf),
        prompt_data=str(prompts["jsonl"]),
        input_key="problem",
        label_key="answer",
        multimodal_keys={"image": "images"},
        apply_chat_template=True,
        rm_type="math",
        rollout_function_path=opts.rollout_function_path,
        custom_config_path=str(fixtures.write_custom_config(tmp, root, turnstile, "custom_config")),
        rollout_batch_size=2,
        n_samples_per_prompt=4,
        global_batch_size=8,
        num_rollout=3,
        rollout_max_response_len=96,
        rollout_temperature=1.0,
        advantage_estimator="grpo",
    )
    evaluation = dict(
        eval_config=str(fixtures.write_eval_config(tmp, prompts["jsonl"])),
        n_samples_per_eval_prompt=2,
        log_passrate=True,
    )
    print(
        f"FIXTURES {tmp}: {len(fixtures.PROBLEMS)} geometry problems ({', '.join(sorted(prompts))}), HF checkpoint "
        f"{hf.name}, reward module {fixtures.RM_MODULE} ({time.monotonic() - started:.1f} s)",
        flush=True,
    )

    mod, filt = fixtures.RM_MODULE, "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
    catalogue = {  # name: (settings over `base`, steps, eval, scripted server)
        "embedded/jsonl": (evaluation, 3, True, False),
        "embedded/parquet": ({"prompt_data": str(prompts.get("parquet"))}, 1, False, False),
        "scripted/math+filter+eval": (
            {
                **evaluation,
                "dynamic_sampling_filter_path": filt,
                "over_sampling_batch_size": 4,
                "rollout_all_samples_process_path": f"{mod}.process_all",
            },
            2,
            True,
            True,
        ),  # fmt: skip
        "scripted/custom-rm+hooks": (
            {
                "custom_rm_path": f"{mod}.custom_rm",
                "rollout_sample_hook_path": f"{mod}.hook",
                "rollout_sample_filter_path": f"{mod}.sample_filter",
            },
            2,
            False,
            True,
        ),  # fmt: skip
        "scripted/group-rm+reward-key": (
            {"group_rm": True, "custom_rm_path": f"{mod}.group_rm", "reward_key": "acc"},
            2,
            False,
            True,
        ),
    }
    assert (*catalogue, EXAMPLE_RUN) == RUN_NAMES
    runs = []
    for name in [name.strip() for name in opts.runs.split(",") if name.strip()]:
        if name not in RUN_NAMES:
            print(f"unknown run {name!r}; runs: {RUN_NAMES}", file=sys.stderr)
            return 2
        if name in ("embedded/parquet", EXAMPLE_RUN) and "parquet" not in prompts:
            results.skip(name, "parquet prompts", "pyarrow is not installed")
            continue
        if name == EXAMPLE_RUN:  # its settings come from the example's files (example.prepare, just before it runs)
            from scripts.slime_train_path.example import STEPS

            runs.append(Run(name, {}, steps=STEPS, scripted=True))
            continue
        settings, steps, evaluate, scripted = catalogue[name]
        runs.append(Run(name, {**base, **settings}, steps=steps, evaluate=evaluate, scripted=scripted))

    from scripts.slime_train_path.double import Geo3kServer

    hung = False
    for run in runs:
        run.slime, run.tokenizer, run.processor, run.log = s, tokenizer, processor, log
        uses = any(isinstance(v, str) and v.startswith(f"{mod}.") for v in run.settings.values())
        run.rm_module = rm_module if uses else None
        for record in (rm_module.CALLS, rm_module.HOOKED, rm_module.FILTERED, rm_module.PROCESSED):
            record.clear()
        if run.name == EXAMPLE_RUN:
            from scripts.slime_train_path import example

            try:
                run.example = example.prepare(root, tmp, prompts["parquet"], hf, opts.rollout_function_path, run.steps)
            except Exception as exc:
                results.error(run.name, "the example's run.sh and turnstile.yaml", exc)
                continue
            run.settings, run.note = run.example.settings, run.example.note()
            for line in run.example.yaml_overrides:
                print(f"OVERRIDE [{run.name}] {line}", flush=True)
        if run.scripted:  # a fresh server per run, left running: the run's rollout service may still call it
            hold = bool(run.settings.get("partial_rollout"))  # a group paused mid-episode at each step's end
            run.server = Geo3kServer(tokenizer, processor, hold_one_group=hold).__enter__()
            host, port = run.server.url.removeprefix("http://").split(":")
            run.settings = {**run.settings, "sglang_router_ip": host, "sglang_router_port": int(port)}
        print(
            f"RUN   {run.name} ({run.steps} step(s){', eval' if run.evaluate else ''}; "
            f"{'scripted SGLang server ' + run.server.url if run.scripted else 'embedded tiny Qwen2.5-VL'})",
            flush=True,
        )
        started = time.monotonic()
        try:
            execute(run, results, opts.step_timeout)
        except Exception as exc:  # a check that broke: say so and go on with the next run
            results.error(run.name, "the run's checks", exc)
        if run.example is not None:
            from scripts.slime_train_path.example import teardown

            print(f"      {run.name}: {teardown(run, run.example)}", flush=True)
        print(f"      {run.name} took {time.monotonic() - started:.1f} s", flush=True)
        hung |= run.hung
    print(f"\nslime commit {slime_commit(root, opts.slime_commit)}; {results.summary()}")
    for r in results.failed:
        print(f"  FAIL [{r.run}] {r.name}")
    if not opts.keep_tmp:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    if hung:
        print("a rollout call hung: exiting without waiting for the bridge's threads")
    return 1 if results.failed else 0


def entry() -> None:
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The bridge's rollout services (threads with their engines, registered with atexit) are not shut down:
    # a service that hung would hold the exit forever.
    os._exit(code)
