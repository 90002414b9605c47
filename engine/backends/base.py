"""The backend protocol: what the turn loop asks of an inference server.

SGLang's HTTP API is the reference (`/generate`, `/abort_request`, `/pause_generation`,
`/continue_generation`, `/model_info`, `/health`); the local backend gives the same
semantics in process. Failures are raised as `engine.errors.BackendError`, classified. A backend
that places sessions over several servers may also have `end_session(session_id)`, which the scheduler
calls once a trajectory has ended (BackendPool: the session no longer counts where it was placed).

    async with SGLangBackend("http://127.0.0.1:30000") as backend:   # an SGLang server or an sglang-router
        params = SamplingParams(max_new_tokens=256, stop_token_ids=(151645,))
        result = await backend.generate(prompt_ids, params, session_id=trajectory_id)
        result.token_ids, result.logprobs, result.finish_reason   # finish_reason: stop | length | abort

Streaming. A backend that can hand a generation's tokens over as it produces them says so with the class
attribute `streams = True`, and its `generate` then takes `on_tokens`, a listener called with each run of new
token ids, in order, on the event loop's thread, while the generation runs (never after `generate` returned).
The runs joined are the result's `token_ids`; the result itself is what it would be without a listener. The
caller passes `on_tokens` only to a backend that `can_stream`, so a backend without the attribute is called as
before. A listener must be quick (it runs on the loop: hand the tokens to a queue); one that raises is logged
and dropped by the backend, and the generation goes on.

    if can_stream(backend):
        result = await backend.generate(prompt_ids, params, on_tokens=lambda ids: queue.send_nowait(ids))

Token buffers. A backend whose `generate` reads `input_ids` as an integer buffer (an `array("i")`, an ndarray)
without a Python loop over them says so with `token_buffers = True`; the turn loop then hands it a copy of the
trajectory's token array (a memory copy) rather than a list built id by id, which at 64k tokens of history cost
more of the loop than the rest of the turn (benchmarks/scale/context_cost.py).

A stream that breaks after some tokens arrived ends as an aborted generation (finish_reason `abort`) holding
the tokens the listener got, with `meta[STREAM_BROKEN]` saying why, so the caller continues the turn from them
(the scheduler retries it as a SERVER error) and no token is lost or sent twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]
TokenListener = Callable[[list[int]], None]
STREAM_BROKEN = "stream_broken"  # GenerateResult.meta key: why the stream of an aborted generation broke

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReportedLoad:
    """What one server reports it runs (SGLang's `GET /v1/loads`, summed over its data-parallel ranks): requests
    running and waiting, the most it runs at once, and the share of its KV cache in use (0 to 1). A backend that
    can report it has `async def reported_loads() -> list[ReportedLoad] | None` (None: its servers do not say)."""

    running: int
    waiting: int
    max_running: int
    token_usage: float = 0.0
    used_tokens: int = 0  # KV tokens in use (`num_used_tokens`; 0 where the server does not say)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling, with SGLang's field names. `temperature=0` is greedy."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    ignore_eos: bool = False  # keep generating past the tokenizer's EOS (benchmarks)
    sampling_seed: int | None = None  # SGLang's per-request seed (honoured with deterministic inference)
    min_new_tokens: int = 0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"bad sampling params: temperature={self.temperature}, top_p={self.top_p}")

    def to_sglang(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "skip_special_tokens": self.skip_special_tokens,
        }
        if self.ignore_eos:
            params["ignore_eos"] = True
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            params["stop"] = list(self.stop)
            params["no_stop_trim"] = True  # keep a matched stop string in the reply: it is the model's text
        if self.sampling_seed is not None:
            params["sampling_seed"] = self.sampling_seed
        if self.min_new_tokens:
            params["min_new_tokens"] = self.min_new_tokens
        if self.repetition_penalty != 1.0:
            params["repetition_penalty"] = self.repetition_penalty
        return params

    def unsupported_locally(self) -> list[str]:
        """The settings an in-process backend cannot honour (they need an SGLang server)."""
        defaults = {"sampling_seed": None, "min_new_tokens": 0, "repetition_penalty": 1.0}
        return [f"{name}={getattr(self, name)!r}" for name, value in defaults.items() if getattr(self, name) != value]


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """One generation. `token_ids` include the stop token when one was produced."""

    token_ids: list[int]
    logprobs: list[float]  # log-prob of each token in token_ids under the sampling distribution
    text: str
    finish_reason: FinishReason
    weight_version: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams,
        image_data: Sequence[str] | None = None,
        *,
        rid: str | None = None,
        session_id: str | None = None,
    ) -> GenerateResult:
        """Generate from `input_ids` (images, if any, in `image_data`). `rid` names the request for abort.
        `session_id` names the conversation (a trajectory): a backend over several servers sends its turns
        to one server while it is healthy, so they reuse its prefix cache; one server ignores it."""
        ...

    async def abort(self, rid: str | None = None) -> None:
        """Abort this backend's request `rid`, or every request of this backend when `rid` is None (never
        other clients' requests on a shared server). Aborted requests return what they generated so far with
        finish_reason `abort`."""
        ...

    async def pause(self) -> None:
        """Stop generating (for a weight update); requests in flight wait until `resume`."""
        ...

    async def resume(self) -> None: ...

    async def weight_version(self) -> str | None: ...

    async def health(self) -> bool: ...

    async def health_problem(self) -> str | None:
        """None when healthy, else why not, in words a person can act on (the CLI's start-up check)."""
        ...

    async def aclose(self) -> None: ...


def can_stream(backend: object) -> bool:
    """Whether `backend.generate` takes a token listener (`on_tokens`); see the module docstring."""
    return getattr(backend, "streams", False) is True


def takes_token_buffers(backend: object) -> bool:
    """Whether `backend.generate` reads `input_ids` as an integer buffer; see the module docstring."""
    return getattr(backend, "token_buffers", False) is True


def notify(listener: TokenListener | None, token_ids: list[int]) -> TokenListener | None:
    """Call `listener` with `token_ids` (when there are any); the listener to call next time: None once it raised
    (logged), so a failing listener is dropped and the generation goes on."""
    if listener is None or not token_ids:
        return listener
    try:
        listener(token_ids)
    except Exception as exc:  # noqa: BLE001 -- the listener's failure is its own, never the generation's
        log.warning("a token listener raised; it gets no more tokens of this generation", exc_info=exc)
        return None
    return listener
