"""The judge's settings: where the judge model is, how it is asked, and what a failure gives.

One pydantic model, filled from three places, later ones winning:

    TURNSTILE_JUDGE_<FIELD> environment variables     TURNSTILE_JUDGE_URL=http://10.0.0.7:30000
    a `judge:` mapping on slime's args                 (slime's --custom-config-path YAML sets `args.judge`)
    keywords given in code                             JudgeSettings.from_sources(args, max_batch_size=8)

With no `url` the judge runs the embedded default's tiny local model in process (engine/backends/local.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

ENV_PREFIX = "TURNSTILE_JUDGE_"


class JudgeSettings(BaseModel):
    """Every knob of the LLM judge; see docs/envs/judge.md."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    url: str | None = None
    """The judge server, e.g. http://127.0.0.1:30000; none: the embedded default's tiny local model."""
    api: Literal["sglang", "openai"] = "sglang"
    """`sglang`: SGLang's native POST /generate, a batch in one request; `openai`: POST /v1/chat/completions,
    one conversation per request (SGLang, vLLM and hosted APIs serve it)."""
    model: str = "default"
    """The `model` field of an OpenAI-compatible request."""
    tokenizer: str | None = None
    """For api=sglang: a tokenizer (`qwen2.5` or a directory) whose chat template renders the judge prompt,
    sent as input_ids; none: the judge prompt goes as plain `text`."""
    api_key_env: str | None = None
    """The name of an environment variable holding a bearer token for the judge server (never the token)."""
    rubric_path: str | None = None
    """A rubric prompt file; none: the rubric shipped with the package (engine/envs/judge/rubric.md)."""
    max_score: float = Field(10.0, gt=0)
    """The top of the rubric's scale; the reward is the judge's score divided by it (0..1)."""
    max_batch_size: PositiveInt = 16
    """Conversations sent to the judge together, at most."""
    batch_window_s: float = Field(0.02, ge=0)
    """How long the first conversation of a batch waits for others to join it."""
    max_concurrent_batches: PositiveInt = 8
    """Batches (or, for api=openai, requests) in flight at once."""
    timeout_s: float = Field(60.0, gt=0)
    """Seconds one judge request may take before it is a timeout (then retried)."""
    max_retries: int = Field(3, ge=0)
    """Retries of a request after a connection error, an HTTP 5xx or a timeout."""
    backoff_base_s: float = Field(0.5, ge=0)
    """Backoff before retry n: uniform in [0, min(backoff_max_s, backoff_base_s * 2**n)] seconds."""
    backoff_max_s: float = Field(8.0, ge=0)
    """The cap of a backoff, seconds."""
    max_new_tokens: PositiveInt = 128
    """Tokens the judge may write: a short critique and the score line."""
    temperature: float = Field(0.0, ge=0)
    """The judge's sampling temperature (0: greedy)."""
    on_error: Literal["fail", "fallback"] | None = None
    """When the judge gives no score: `fail` raises JudgeError (the trajectory's reward fails), `fallback`
    gives `fallback_score`; none: `fail` with a url, `fallback` for the local model (it has random weights)."""
    fallback_score: float = 0.0
    """The reward when the judge gives no score and the policy is `fallback`."""
    local_model: str = "tiny-qwen2"
    """The local judge model (an engine.models name or a path), used when there is no url."""

    @property
    def error_policy(self) -> Literal["fail", "fallback"]:
        if self.on_error is not None:
            return self.on_error
        return "fail" if self.url else "fallback"

    @property
    def key(self) -> str:
        """Equal for equal settings: one shared judge per key."""
        return self.model_dump_json()

    @classmethod
    def from_sources(cls, args: Any = None, **overrides: Any) -> JudgeSettings:
        """Environment variables, then `args.judge` (a mapping), then `overrides`. A bad value raises
        pydantic's ValidationError, naming the field."""
        given = getattr(args, "judge", None) if args is not None else None
        if given is not None and not isinstance(given, Mapping):
            raise ValueError(f"the `judge` setting must be a mapping of judge settings, got {type(given).__name__}")
        return cls.model_validate({**from_environment(), **(given or {}), **overrides})


def from_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The TURNSTILE_JUDGE_<FIELD> variables that are set, by field name; an unknown one is refused."""
    environ = os.environ if environ is None else environ
    values = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        field = name.removeprefix(ENV_PREFIX).lower()
        if field not in JudgeSettings.model_fields:
            known = ", ".join(ENV_PREFIX + f.upper() for f in JudgeSettings.model_fields)
            raise ValueError(f"{name}: no such judge setting (known: {known})")
        values[field] = value
    return values
