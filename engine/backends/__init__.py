"""Inference backends: SGLang over HTTP (production) and an in-process model (the embedded default)."""

from engine.backends.base import Backend, FinishReason, GenerateResult, SamplingParams

__all__ = ["Backend", "FinishReason", "GenerateResult", "SamplingParams"]
