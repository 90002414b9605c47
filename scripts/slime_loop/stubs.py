"""Stand-ins for what slime's driver imports and this machine cannot install: Megatron's parallel state (one
rank, no model parallelism) on top of the train-path script's (sglang, wandb; scripts/slime_train_path/stubs.py).

Each stub is made only when the real import fails, and printed with why. `install` runs in the driver and,
through Ray's `worker_process_setup_hook`, in every Ray worker (RolloutManager, the trainer), before slime's
modules are imported there.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import torch

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
        "does not use (one right-padded forward per micro-batch)",
    ),
}


@dataclasses.dataclass
class _ServerArgs:
    """sglang.srt.server_args.ServerArgs, the fields slime's `_compute_server_args` fills for an engine (it lists
    `dataclasses.fields(ServerArgs)`; for external engines nothing is launched from them) and the parallel sizes
    its parser adds as --sglang-dp-size / -pp-size / -ep-size."""

    model_path: str = ""
    trust_remote_code: bool = False
    random_seed: int = 0
    enable_memory_saver: bool = False
    host: str = "127.0.0.1"
    port: int = 30000
    nccl_port: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    gpu_id_step: int = 1
    base_gpu_id: int = 0
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    enable_dp_attention: bool = False
    skip_server_warmup: bool = False
    enable_draft_weights_cpu_backup: bool = False
    enable_metrics: bool = False
    mem_fraction_static: float | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for name in ("dp-size", "pp-size", "ep-size"):
            parser.add_argument(f"--{name}", type=int, default=1)
        parser.add_argument("--enable-dp-attention", action="store_true")


SGLANG_ENGINE: dict[str, tuple[dict[str, Any], str]] = {
    "sglang.srt.server_args": (
        {"ServerArgs": _ServerArgs},
        "sglang is not installable beside slime here (it pins its own torch; the SGLang servers run from their "
        "own venv): slime's parser adds SGLang's server flags from ServerArgs and its SGLangEngine actor builds "
        "each engine's ServerArgs fields; the stand-in has those fields and the parallel sizes' flags (1)",
    ),
}


class CpuAccelerator:
    """slime's Accelerator for a machine with no accelerator, registered through slime's own
    `register_accelerator` (slime/utils/accelerator). SGLangEngine.init maps its engine's GPU id through the
    accelerator even for external engines; here ids map to themselves, and there is no device memory."""

    name = "cpu"
    device_type = "cpu"
    communication_backend_name = "gloo"

    def is_available(self) -> bool:
        return True

    def device(self, index: Any = None) -> torch.device:
        return torch.device("cpu")

    def device_name(self, index: Any = None) -> str:
        return "cpu"

    def set_device(self, index: Any) -> None:
        return None

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def synchronize(self, device: Any = None) -> None:
        return None

    def current_stream(self, device: Any = None) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * size, os.sysconf("SC_PHYS_PAGES") * size

    def memory_allocated(self, device: Any = None) -> int:
        return 0

    def memory_reserved(self, device: Any = None) -> int:
        return 0


def register_cpu_accelerator() -> str | None:
    """Register CpuAccelerator with slime where slime finds no other. Returns why, or None if not needed."""
    from slime.utils import accelerator
    from slime.utils.accelerator.base import Accelerator

    if accelerator.initialize_accelerator() is not None:  # slime's own choice: None where nothing is available
        return None
    cls = type("CpuAccelerator", (CpuAccelerator, Accelerator), {})
    accelerator.register_accelerator("cpu", cls, lambda: True, priority=-1000)
    return (
        "no CUDA or MUSA device: slime's SGLangEngine asks the accelerator to map engine GPU ids "
        "(sglang_engine.py `_compute_server_args`); a CPU accelerator registered by slime's register_accelerator"
    )


def install() -> list[tuple[str, str]]:
    """Every stub the loop needs, made where the real import fails. Returns (module, why) of those made."""
    made = train_path_stubs.install({**train_path_stubs.WANTED, **MEGATRON, **SGLANG_ENGINE})
    if why := register_cpu_accelerator():
        made = [*made, ("slime.utils.accelerator: cpu", why)]
    return made


def install_quietly() -> None:
    """Ray's worker_process_setup_hook: the same stubs in each worker (the driver printed them)."""
    install()
