"""A training actor for slime's driver on a CPU, handed to `create_training_models(..., actor_cls=...)`.

It stands where slime's MegatronTrainRayActor stands (slime/backends/megatron_utils/actor.py) and does the
same work in the same order with slime's own functions, on a Hugging Face model instead of a Megatron one:

- `process_rollout_data` takes this rank's share of what RolloutManager put in Ray's object store;
- slime's `DataIterator` walks the micro-batch schedule RolloutManager built (`build_dp_schedule`);
- the old policy's (and, with a KL term, the reference's) log-probs come from slime's
  `get_log_probs_and_entropy`; `compute_advantages_and_returns` makes GRPO returns with the KL;
- slime's `--only-train-params-name-list` / `--freeze-params-name-list` leave trainable what slime's model
  provider would (`batches.freeze`, on the Hugging Face parameter names);
- each training step sums slime's `loss_function` (the clipped policy loss, entropy, KL loss, and the
  rollout-vs-train log-prob mismatch metrics) over its micro-batches, then one AdamW step;
- `update_weights` writes the model as HF weights to `--update-weight-disk-dir/weight_vNNNNNN`, the
  directory slime's RayTrainGroup then hands to the engines' `update_weights_from_disk`.

What Megatron adds (tensor/pipeline/context parallelism, its optimizer, checkpoints) has no place on one CPU
process: one data-parallel rank, no model parallelism. Offloading and the NCCL transport are refused at
`init`, naming the flag.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from slime.backends.megatron_utils.data import DataIterator
from slime.backends.megatron_utils.loss import compute_advantages_and_returns, get_log_probs_and_entropy, loss_function
from slime.ray.train_actor import TrainRayActor
from slime.utils.data import process_rollout_data

from bridge.service import weight_directories
from scripts.slime_loop.batches import freeze, invert_loss_masks, save_hf, window_logits, windows

logger = logging.getLogger(__name__)

KEPT_WEIGHT_VERSIONS = 3  # the newest versions kept on disk (the embedded model loads the newest)
TRAIN_KEYS = [
    "tokens", "total_lengths", "response_lengths", "loss_masks", "log_probs", "ref_log_probs", "advantages",
    "returns", "rollout_log_probs", "rollout_mask_sums",
]  # fmt: skip  # what slime's forward_step asks its DataIterator for, less Megatron's packing


class CpuTrainRayActor(TrainRayActor):
    """slime's TrainRayActor on a CPU: one rank, a Hugging Face model, slime's advantage and loss code."""

    def __init__(self, world_size: int, rank: int, master_addr: str | None, master_port: int | None) -> None:
        # TrainRayActor.__init__ sets these and then asks the accelerator for the Ray GPU's device index; the
        # GPUs here are logical (Ray's --num-gpus on a CPU machine), so there is no device to ask.
        if world_size != 1:
            raise ValueError(
                f"the CPU trainer runs one rank; slime asked for {world_size} (set --actor-num-gpus-per-node 1)"
            )
        self._world_size, self._rank = world_size, rank
        self.master_addr, self.master_port = master_addr or "127.0.0.1", master_port or 0
        os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")

    def init(self, args: Any, role: str, with_ref: bool = False, with_opd_teacher: bool = False) -> int:
        refused = {
            "--offload-train": args.offload_train,
            "--use-critic": args.use_critic,
            "--use-opd with megatron teacher": with_opd_teacher,
            "--keep-old-actor": getattr(args, "keep_old_actor", False),
            "--freeze-indexer (no DSA indexer here)": getattr(args, "freeze_indexer", False),
        }
        if bad := [flag for flag, on in refused.items() if on]:
            raise ValueError(f"the CPU trainer does not support {', '.join(bad)}")
        if (args.update_weight_mode, args.update_weight_transport) != ("full", "disk"):
            raise ValueError(
                "the CPU trainer pushes weights by disk only: set --update-weight-mode full "
                "--update-weight-transport disk --update-weight-disk-dir DIR"
            )
        self.args, self.role, self.with_ref = args, role, with_ref
        args.rank, args.world_size = 0, 1
        torch.manual_seed(args.seed)
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(args.hf_checkpoint, dtype=torch.float32)
        self.model.train()
        freeze(self.model, args)
        self.ref_model = copy.deepcopy(self.model).eval() if with_ref else None
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=args.lr,
            betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, weight_decay=args.weight_decay,
        )  # fmt: skip
        self.train_parallel_config = {
            "dp_size": 1,
            "cp_size": 1,
            "vpp_size": 1,
            "microbatch_group_size_per_vp_stage": 1,
        }
        self.weight_version = args.update_weight_start_version  # RayTrainGroup counts the same way
        self.metrics_path = getattr(args, "loop_metrics_path", None)
        return args.start_rollout_id if args.start_rollout_id is not None else 0

    # -- training --------------------------------------------------------------------------------
    def train(self, rollout_id: int, rollout_data_ref: Any, external_data: Any = None) -> None:
        started = time.monotonic()
        data = process_rollout_data(self.args, rollout_data_ref, 0, 1)
        data["tokens"] = [t.to(torch.long) for t in data["tokens"]]
        data["loss_masks"] = [t.to(torch.int) for t in data["loss_masks"]]
        if "rollout_mask_sums" in data:
            data["rollout_mask_sums"] = torch.as_tensor(data["rollout_mask_sums"], dtype=torch.float32)
        if "rollout_log_probs" in data:
            data["rollout_log_probs"] = [torch.as_tensor(x, dtype=torch.float32) for x in data["rollout_log_probs"]]
        control = getattr(self.args, "loop_control", "none")
        if control == "inverted_mask":  # the negative control: train on the environment's tokens instead
            invert_loss_masks(data)

        windows(data)
        with torch.no_grad():  # the old policy's log-probs (as slime, not when the loss can reuse its own)
            if not self._can_reuse_log_probs_in_loss(data):
                data["log_probs"] = self._log_probs(self.model, data)
            if self.ref_model is not None:
                data["ref_log_probs"] = self._log_probs(self.ref_model, data)
        compute_advantages_and_returns(self.args, data)

        iterator = DataIterator(data, data["micro_batch_indices"])
        steps = []
        for num_microbatches, batch_size in zip(data["num_microbatches"], data["global_batch_sizes"], strict=True):
            self.optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            for _ in range(num_microbatches):
                batch = iterator.get_next([*TRAIN_KEYS, "full_tokens"])
                batch["unconcat_tokens"] = batch["tokens"]
                logits = window_logits(self.model, batch.pop("full_tokens"), batch["total_lengths"])
                loss, _, log = loss_function(self.args, batch, num_microbatches, batch_size, logits)
                (loss / num_microbatches).backward()  # as Megatron's schedule scales each micro-batch's loss
                for key, value in zip(log["keys"], log["values"][1:].tolist(), strict=True):
                    sums[key] = sums.get(key, 0.0) + value
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip_grad)
            self.optimizer.step()
            steps.append({key: value / batch_size for key, value in sums.items()} | {"grad_norm": float(grad_norm)})
        self._record(
            {
                "rollout_id": rollout_id,
                "trained_on_weight_version": self.weight_version,
                "samples": len(data["tokens"]),
                "train_seconds": time.monotonic() - started,
                "steps": steps,
                **({f"train/{k}": sum(s[k] for s in steps) / len(steps) for k in steps[0]} if steps else {}),
            }
        )

    def _can_reuse_log_probs_in_loss(self, data: dict[str, Any]) -> bool:
        """MegatronTrainRayActor.train_actor's rule: one training step, no KL, nothing else needing the old
        policy apart; the loss then takes the old log-probs from its own forward."""
        a = self.args
        return (
            len(data["num_microbatches"]) == 1 and a.loss_type == "policy_loss" and a.kl_coef == 0
            and not a.use_rollout_logprobs and not a.get_mismatch_metrics and a.advantage_estimator != "gspo"
        )  # fmt: skip

    def _log_probs(self, model: torch.nn.Module, data: dict[str, Any]) -> list[torch.Tensor]:
        """Each sample's response log-probs under `model`, by slime's `get_log_probs_and_entropy`, a
        micro-batch's worth of samples per forward."""
        out, size = [], self.args.micro_batch_size
        for start in range(0, len(data["tokens"]), size):
            part = slice(start, start + size)
            logits = window_logits(model, data["full_tokens"][part], data["total_lengths"][part])
            _, res = get_log_probs_and_entropy(
                logits, args=self.args, unconcat_tokens=data["tokens"][part],
                total_lengths=data["total_lengths"][part], response_lengths=data["response_lengths"][part],
            )  # fmt: skip
            out.extend(x.detach() for x in res["log_probs"])
        return out

    # -- weights ----------------------------------------------------------------------------------
    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        if self.args.save_hf is not None:
            save_hf(self.model, Path(self.args.save_hf.format(rollout_id=rollout_id)))

    def update_weights(self) -> None:
        """The full disk path: HF weights at `--update-weight-disk-dir/weight_vNNNNNN`, written whole before
        the directory appears (RayTrainGroup then reloads the engines from it)."""
        if self.args.debug_train_only or self.args.debug_rollout_only:
            return
        self.weight_version += 1
        target = Path(self.args.update_weight_disk_dir) / f"weight_v{self.weight_version:06d}"
        save_hf(self.model, target)
        self._record({"weights_written": str(target), "weight_version": self.weight_version})
        for version, directory in weight_directories(target.parent):  # 20 steps of 8 runs kept whole: 26 GB
            if version <= self.weight_version - KEPT_WEIGHT_VERSIONS:
                shutil.rmtree(directory, ignore_errors=True)

    def sleep(self, tags: Any = None) -> None:
        return None  # nothing is offloaded on a CPU (--offload-train is refused at init)

    def wake_up(self, tags: Any = None) -> None:
        return None

    def clear_memory(self) -> None:
        gc.collect()

    def _get_parallel_config(self) -> dict[str, int]:
        return self.train_parallel_config

    def _record(self, row: dict[str, Any]) -> None:
        logger.info("cpu trainer: %s", {k: v for k, v in row.items() if k != "steps"})
        if self.metrics_path:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps({"source": "trainer", "time": time.time(), **row}) + "\n")
