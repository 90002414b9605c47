"""One run of slime's driver: `python -m scripts.slime_loop.run SPEC.json` (main.py starts one per run).

slime's `train.py` or `train_async.py` is loaded from the checkout and its `train(args)` called as it is; the
one change is the name `create_training_models` in that module, bound to slime's own function with
`actor_cls=CpuTrainRayActor` (the seam slime's megatron_server.py uses). `args` come from slime's parser
(scripts/slime_train_path/slime_args.py: everything of slime's `parse_args` but Megatron's parser), and the
Megatron-owned flags the CPU trainer reads are set as Megatron's parser would set them (MEGATRON_OWNED).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# Megatron's own flags (megatron/training/arguments.py) read on this path: the CPU trainer's optimizer and clipping,
# SGLangEngine's fp16.
MEGATRON_OWNED = {
    "adam_beta1": 0.9, "adam_beta2": 0.98, "adam_eps": 1e-8, "weight_decay": 0.0, "clip_grad": 1.0,
    "fp16": False,
}  # fmt: skip


def slime_flags(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """slime's flags for the run, as `--name value` would give them."""
    flags: dict[str, Any] = {
        "hf_checkpoint": spec["hf_checkpoint"],
        "prompt_data": spec["train_data"],
        "input_key": "messages",
        "label_key": "label",
        "metadata_key": "metadata",
        "apply_chat_template": True,
        "rollout_shuffle": True,
        "rollout_seed": spec["seed"],
        "seed": spec["seed"],
        "num_rollout": spec["steps"],
        "rollout_batch_size": spec["prompts_per_step"],
        "n_samples_per_prompt": spec["samples_per_prompt"],
        # slime's training steps per rollout step: rollouts (here samples) / global batch
        "global_batch_size": spec["prompts_per_step"] * spec["samples_per_prompt"] // spec["train_steps_per_rollout"],
        "micro_batch_size": 16,  # one padded forward per micro-batch
        "rollout_max_response_len": 64,  # two one-digit answers and the feedback between them
        "rollout_temperature": 1.0,
        "rollout_function_path": "bridge.slime.generate_rollout",
        "custom_config_path": spec["custom_config"],
        "custom_rollout_log_function_path": "scripts.slime_loop.hooks.log_rollout",
        "custom_eval_rollout_log_function_path": "scripts.slime_loop.hooks.log_eval",
        "eval_prompt_data": ["heldout", spec["eval_data"]],
        "eval_interval": 1,
        "n_samples_per_eval_prompt": spec["eval_samples_per_prompt"],
        "advantage_estimator": "grpo",
        "lr": spec["lr"],
        # slime's own flag, on the Hugging Face names (`--freeze-params embed_tokens`: the embedding and the
        # output layer tied to it, 151,936 rows that otherwise all take an Adam step each update)
        "freeze_params_name_list": spec.get("freeze_params") or None,
        "dynamic_sampling_filter_path": spec.get("dynamic_filter"),
        "kl_coef": 0.0,
        "entropy_coef": 0.0,
        "actor_num_nodes": 1,
        "actor_num_gpus_per_node": 1,
        "num_gpus_per_node": 1,
        "update_weight_mode": "full",
        "update_weight_transport": "disk",
        "update_weight_disk_dir": str(work / "weights"),
        "update_weight_disk_keep_files": True,  # every step's HF weights stay (and the embedded model needs them)
    }
    if spec["backend"] == "embedded":
        # slime starts no SGLang engine; the router address is given so that slime does not start a router
        # with no workers (Turnstile generates with the embedded model on --hf-checkpoint; nothing calls it)
        flags |= {"rollout_num_gpus": 0, "sglang_router_ip": "127.0.0.1", "sglang_router_port": 1}
    else:
        # SGLang servers started beforehand (main.py): slime asks each for its server info, makes an SGLangEngine
        # actor per server, starts sglang-router itself with its defaults (policy cache_aware), registers the
        # servers with it, and reloads their weights from each step's directory, then deletes the directory
        flags |= {
            "rollout_external_engine_addrs": spec["sglang_urls"],
            "rollout_num_gpus_per_engine": 1,
            "update_weight_disk_keep_files": False,
        }
    if spec.get("partial_rollout"):
        flags |= {"partial_rollout": True, "over_sampling_batch_size": spec["prompts_per_step"] * 2}
    return flags


def load_driver(slime: Path, name: str) -> Any:
    """slime's train.py / train_async.py as a module, its `create_training_models` given the CPU trainer."""
    from slime.ray.placement_group import create_training_models

    from scripts.slime_loop.trainer import CpuTrainRayActor

    spec = importlib.util.spec_from_file_location(f"slime_{name}", slime / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.create_training_models = functools.partial(create_training_models, actor_cls=CpuTrainRayActor)
    return module


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    slime, work = Path(spec["slime"]), Path(spec["work"])
    sys.path[:0] = [str(slime), str(REPO)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(slime), str(REPO), os.environ.get("PYTHONPATH", "")])
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # slime's @torch.compile'd helpers, run eagerly

    from scripts.slime_loop import stubs
    from scripts.slime_train_path import slime_args

    made = stubs.install()
    for module, why in made:
        print(f"STUB {module}: {why}", flush=True)
    (work / "stubs.json").write_text(json.dumps(dict(made), indent=2))
    args = slime_args.parse(slime_args.to_argv(slime_flags(spec, work)))
    for key, value in MEGATRON_OWNED.items():
        setattr(args, key, value)
    args.loop_metrics_path = str(work / "metrics.jsonl")
    Path(args.loop_metrics_path).unlink(missing_ok=True)
    shutil.rmtree(work / "weights", ignore_errors=True)
    args.loop_control = spec["control"]

    import ray

    ray.init(
        num_cpus=6, num_gpus=1, include_dashboard=False, object_store_memory=512 * 1024**2,
        runtime_env={
            "worker_process_setup_hook": "scripts.slime_loop.stubs.install_quietly",
            "env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"], "TORCHDYNAMO_DISABLE": "1"},
        },
    )  # fmt: skip
    started = time.monotonic()
    try:
        load_driver(slime, spec["driver"]).train(args)
    finally:
        wall = time.monotonic() - started
        ray.shutdown()
    (work / "wall.json").write_text(json.dumps({"wall_seconds": wall}))
    print(f"run done in {wall:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
