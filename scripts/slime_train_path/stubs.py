"""Stand-ins for the imports of slime's modules that cannot be installed here, and nothing else.

Each stub is made only when the real import fails, holds only the names slime's modules import, and is
printed with why it was needed. The one patch of slime itself is `logging_utils.log` (the wandb /
tensorboard call of `log_rollout_data` / `log_eval_rollout_data`), which records what it is given.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

MADE: list[tuple[str, str]] = []  # (module, why), in the order made


class _ServerArgs:
    """sglang.srt.server_args.ServerArgs: slime's `add_sglang_arguments` asks it for SGLang's server flags."""

    @staticmethod
    def add_cli_args(parser: Any) -> None:  # SGLang's own --sglang-* server flags: none here
        return None


class _RouterArgs:
    @staticmethod
    def add_cli_args(parser: Any, use_router_prefix: bool = False, exclude_host_port: bool = False) -> None:
        return None


def _kill_process_tree(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("stub: sglang.srt.utils.kill_process_tree is not available (sglang is not installed)")


def _remote(*args: Any, **kwargs: Any) -> Any:
    """ray.remote as a no-op decorator: `@ray.remote` leaves the class plain (`ray.remote(...)` too)."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda cls: cls


def _no_ray(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("stub: Ray is not installed; no Ray call is made on the path this script runs")


class _Strategy:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs


# module -> (names it must hold, why it is needed)
WANTED: dict[str, tuple[dict[str, Any], str]] = {
    "sglang.srt.server_args": (
        {"ServerArgs": _ServerArgs},
        "sglang (a GPU-only server) is not installable here; slime.utils.arguments imports "
        "slime.backends.sglang_utils.arguments, which imports ServerArgs to add SGLang's --sglang-* server "
        "flags (none are added: no function run here reads them), and slime.ray.rollout imports sglang_engine",
    ),
    "sglang.srt.constants": (
        {
            "GPU_MEMORY_TYPE_CUDA_GRAPH": "cuda_graph",
            "GPU_MEMORY_TYPE_KV_CACHE": "kv_cache",
            "GPU_MEMORY_TYPE_WEIGHTS": "weights",
        },
        "imported at the top of slime.ray.rollout for the engines' offload tags; RolloutManager's "
        "post-processing methods run here never use them",
    ),
    "sglang.srt.utils": (
        {"kill_process_tree": _kill_process_tree},
        "imported by slime.backends.sglang_utils.sglang_engine (imported by slime.ray.rollout) to stop "
        "SGLang servers; none is started here",
    ),
    "sglang_router.launch_router": (
        {"RouterArgs": _RouterArgs},
        "sglang-router (the Rust gateway) is missing; slime's router flags other than --sglang-router-ip/port "
        "are not added",
    ),
    "ray": (
        {"remote": _remote, "get": _no_ray, "put": _no_ray, "kill": _no_ray, "is_initialized": lambda: False},
        "Ray is not installed; slime.utils.data, slime.ray.rollout and its imports import it at the top, and "
        "RolloutManager is a @ray.remote class (the stub leaves it a plain class; no actor is made here)",
    ),
    "ray.util.scheduling_strategies": (
        {"PlacementGroupSchedulingStrategy": _Strategy, "NodeAffinitySchedulingStrategy": _Strategy},
        "imported at the top of slime.ray.rollout for placing SGLang engines; none is placed here",
    ),
    "wandb": (
        {},
        "wandb (a tracking client) is not installed; slime.observability.logging_utils and wandb_utils import "
        "it at the top, and only their tracking calls use it, which this script replaces "
        "(logging_utils.log records instead)",
    ),
}


def install(wanted: dict[str, tuple[dict[str, Any], str]] | None = None) -> list[tuple[str, str]]:
    """Stub each module of `wanted` (default WANTED) whose real import fails (or lacks a wanted name).
    Returns what was made."""
    for module, (names, why) in (WANTED if wanted is None else wanted).items():
        try:
            real = importlib.import_module(module)
            if all(hasattr(real, name) for name in names):
                continue
        except ImportError:
            pass
        _make(module, names)
        MADE.append((module, why))
    return list(MADE)


def _make(module: str, names: dict[str, Any]) -> None:
    parts = module.split(".")
    for depth in range(1, len(parts)):  # parents that do not import become empty packages
        parent = ".".join(parts[:depth])
        if parent in sys.modules:
            continue
        try:
            importlib.import_module(parent)
        except ImportError:
            sys.modules[parent] = _module(parent, {})
    stub = _module(module, names)
    sys.modules[module] = stub
    if len(parts) > 1:
        setattr(sys.modules[".".join(parts[:-1])], parts[-1], stub)


def _module(name: str, names: dict[str, Any]) -> types.ModuleType:
    module = types.ModuleType(name, f"stub made by scripts/slime_train_path (see {__name__})")
    module.__path__ = []  # a package, so stubbed submodules import
    module.__dict__.update(names)
    return module


class LogRecorder:
    """slime.observability.logging_utils.log, replaced: each call's metrics dict is kept, nothing is sent."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], str]] = []

    def __call__(self, args: Any, metrics: dict[str, Any], step_key: str) -> None:
        self.calls.append((dict(metrics), step_key))

    def last(self) -> dict[str, Any]:
        return self.calls[-1][0] if self.calls else {}


def patch_log() -> LogRecorder:
    from slime.observability import logging_utils

    recorder = LogRecorder()
    logging_utils.log = recorder
    return recorder
