"""Environments: slime's interaction-env contract, the loader, and the built-in envs."""

from engine.envs.base import AsyncInteractionEnv, BaseInteractionEnv, EnvRunner, StepResult

__all__ = ["AsyncInteractionEnv", "BaseInteractionEnv", "EnvRunner", "StepResult"]
