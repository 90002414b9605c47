"""Environments: slime's interaction-env contract, the loader, and the built-in envs."""

from engine.envs.base import AsyncInteractionEnv, BaseInteractionEnv, EnvRunner, StepResult
from engine.envs.loader import EnvFactory, EnvLoadError, EnvSample, load_env_module

__all__ = [
    "AsyncInteractionEnv",
    "BaseInteractionEnv",
    "EnvFactory",
    "EnvLoadError",
    "EnvRunner",
    "EnvSample",
    "StepResult",
    "load_env_module",
]
