"""Stand-ins for what slime's driver imports and this machine cannot install: Megatron's parallel state (one
rank, no model parallelism) on top of the train-path script's (sglang, wandb; scripts/slime_train_path/stubs.py).

Each stub is made only when the real import fails, and printed with why. `install` runs in the driver and,
through Ray's `worker_process_setup_hook`, in every Ray worker (RolloutManager, the trainer), before slime's
modules are imported there.
"""

from __future__ import annotations

from typing import Any

from scripts.slime_train_path import stubs as train_path_stubs


def _one(*args: Any, **kwargs: Any) -> int:
    return 1


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _none(*args: Any, **kwargs: Any) -> None:
    return None


def _true(*args: Any, **kwargs: Any) -> bool:
    return True


class _PackedSeqParams:
    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


MEGATRON: dict[str, tuple[dict[str, Any], str]] = {
    "megatron.core.mpu": (
        {
            "is_pipeline_last_stage": _true,
            "is_pipeline_first_stage": _true,
            "get_context_parallel_world_size": _one,
            "get_context_parallel_rank": _zero,
            "get_tensor_model_parallel_world_size": _one,
            "get_tensor_model_parallel_rank": _zero,
            "get_tensor_model_parallel_group": _none,
            "get_data_parallel_world_size": _one,
            "get_data_parallel_rank": _zero,
            "get_data_parallel_group": _none,
            "get_virtual_pipeline_model_parallel_world_size": _none,
        },
        "Megatron-LM (CUDA-only training) is not installable here; slime's loss, advantage and data code "
        "(megatron_utils/loss.py, cp_utils.py, data.py) ask its parallel state for ranks and groups: the CPU "
        "trainer is one rank with no tensor, pipeline or context parallelism (sizes 1, ranks 0, no groups)",
    ),
    "megatron.core.packed_seq_params": (
        {"PackedSeqParams": _PackedSeqParams},
        "imported at the top of megatron_utils/data.py for Megatron's packed forward, which the CPU trainer "
        "does not use (each sample is its own forward)",
    ),
}


def install() -> list[tuple[str, str]]:
    """Every stub the loop needs, made where the real import fails. Returns (module, why) of those made."""
    return train_path_stubs.install({**train_path_stubs.WANTED, **MEGATRON})


def install_quietly() -> None:
    """Ray's worker_process_setup_hook: the same stubs in each worker (the driver printed them)."""
    install()
