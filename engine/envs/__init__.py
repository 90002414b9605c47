"""Environments: slime's interaction-env contract, the loader, and the built-in envs."""

from engine.envs.base import AsyncInteractionEnv, BaseInteractionEnv, EnvRunner, StepResult
from engine.envs.builtin import BUILTIN_ENVS, resolve_env_path
from engine.envs.loader import EnvFactory, EnvLoadError, EnvSample, load_env_module

__all__ = [
    "BUILTIN_ENVS",
    "AsyncInteractionEnv",
    "BaseInteractionEnv",
    "EnvFactory",
    "EnvLoadError",
    "EnvRunner",
    "EnvSample",
    "StepResult",
    "load_env_module",
    "resolve_env_path",
]
