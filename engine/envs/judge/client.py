"""The LLM judge: scores a conversation with a second model, batching, with a timeout and a retry budget.

    judge = Judge(JudgeSettings(url="http://127.0.0.1:30000"))
    verdict = await judge.judge([{"role": "user", "content": "Explain DNS."}, {"role": "assistant", ...}])
    verdict.score, verdict.reply, verdict.error          # 0..1 or None; the judge's text; a JudgeError or None
    reward = await judge.score(conversation)             # the same, by the settings' error policy
    await judge.aclose()

Batching: the first conversation to arrive opens a batch and waits `batch_window_s` (or until
`max_batch_size` have joined), then sends them together; later arrivals open the next batch. The batch is
sent on behalf of everyone in it, shielded from its opener's cancellation, so nobody is left without an
answer. A batch whose request fails is sent again one conversation at a time, so one conversation the
server chokes on fails alone.

Retries: a connection error, an HTTP 5xx or a timeout (`timeout_s` per request) is retried up to
`max_retries` times with full-jitter backoff; an HTTP 4xx or a malformed reply is not. A failure that
spends them, or a reply without a score, is a `JudgeError` (class `judge`), counted by kind in
`statistics()`. A judge is used on one event loop (its connection pool belongs to it); see
engine/envs/judge/shared.py for one judge per loop.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio

from engine.envs.judge.errors import JudgeError
from engine.envs.judge.prompt import Rubric, critique_of, parse_score
from engine.envs.judge.settings import JudgeSettings
from engine.envs.judge.transports import (
    LocalModelHost,
    LocalTransport,
    Messages,
    OpenAITransport,
    SGLangTransport,
    Transport,
    auth_headers,
    http_client,
)
from engine.errors import BackendError, ErrorClass

log = logging.getLogger(__name__)

RETRYABLE = frozenset({ErrorClass.CONNECTION, ErrorClass.SERVER, ErrorClass.TIMEOUT})


@dataclass(frozen=True, slots=True)
class Verdict:
    """The judge on one conversation: `score` in 0..1 (None when it gave none), `raw_score` on the
    rubric's scale, the judge's `reply` ("" when no reply came), and the `error` when there is no score."""

    score: float | None
    raw_score: float | None
    reply: str
    error: JudgeError | None = None

    @property
    def critique(self) -> str:
        return critique_of(self.reply)


@dataclass(frozen=True, slots=True)
class JudgeStatistics:
    num_requests: int  # conversations asked about
    num_scored: int  # of those, with a score
    num_batches: int  # requests sent to the judge model (a batch each), retries not counted
    largest_batch: int
    num_retries: int
    failures: dict[str, int]  # conversations without a score, by JudgeError kind


@dataclass(eq=False, slots=True)
class _Item:
    messages: Messages
    done: anyio.Event = field(default_factory=anyio.Event)
    outcome: str | JudgeError | None = None  # the reply text, or why there is none

    def resolve(self, outcome: str | JudgeError) -> None:
        self.outcome = outcome
        self.done.set()


@dataclass(eq=False, slots=True)
class _Batch:
    items: list[_Item] = field(default_factory=list)
    sealed: anyio.Event = field(default_factory=anyio.Event)


class Judge:
    """See the module docstring. `transport` replaces the one the settings name (tests);
    `local_host` is the local model to use without a url (default: one of this judge's own)."""

    def __init__(
        self,
        settings: JudgeSettings | None = None,
        *,
        transport: Transport | None = None,
        local_host: LocalModelHost | None = None,
    ):
        self.settings = settings or JudgeSettings()
        self.rubric = Rubric.load(self.settings.rubric_path, max_score=self.settings.max_score)
        if transport is None and self.settings.url:
            auth_headers(self.settings)  # an unset token variable is refused here, not at the first request
        self._transport = transport
        self._local_host = local_host
        self._open: _Batch | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        self._counts: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._largest = 0
        self._rng = random.Random()

    async def __aenter__(self) -> Judge:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._transport is not None:
            await self._transport.aclose()

    # -- scoring ---------------------------------------------------------------------------------
    async def judge(self, conversation: list[dict[str, Any]]) -> Verdict:
        """The judge's verdict on `conversation` (chat messages; the last is the answer judged). Never
        raises for a failure of the judge: it is the verdict's `error`."""
        outcome = await self._submit(self.rubric.messages(conversation))
        if isinstance(outcome, JudgeError):
            return self._failed(Verdict(None, None, "", outcome))
        try:
            raw = parse_score(outcome, self.settings.max_score)
        except JudgeError as exc:
            return self._failed(Verdict(None, None, outcome, exc))
        self._counts["num_scored"] += 1
        return Verdict(raw / self.settings.max_score, raw, outcome)

    async def score(self, conversation: list[dict[str, Any]]) -> float:
        """The reward for `conversation`: the verdict's score; without one, `fallback_score` under the
        `fallback` policy, else the JudgeError is raised."""
        verdict = await self.judge(conversation)
        if verdict.error is None:
            return verdict.score
        if self.settings.error_policy == "fallback":
            return self.settings.fallback_score
        raise verdict.error

    def statistics(self) -> JudgeStatistics:
        return JudgeStatistics(
            num_requests=self._counts["num_requests"],
            num_scored=self._counts["num_scored"],
            num_batches=self._counts["num_batches"],
            largest_batch=self._largest,
            num_retries=self._counts["num_retries"],
            failures=dict(self._failures),
        )

    def _failed(self, verdict: Verdict) -> Verdict:
        kind = verdict.error.kind
        if not self._failures[kind]:
            log.warning("the judge gave no score (%s): %s", kind, verdict.error.message)
        self._failures[kind] += 1
        return verdict

    # -- batching --------------------------------------------------------------------------------
    async def _submit(self, messages: Messages) -> str | JudgeError:
        """Join the open batch, or open one and send it when its window closes or it is full."""
        item = _Item(messages)
        batch, is_opener = self._open, self._open is None
        if batch is None:
            batch = self._open = _Batch()
        batch.items.append(item)
        self._counts["num_requests"] += 1
        if len(batch.items) >= self.settings.max_batch_size:
            self._seal(batch)
        if is_opener:
            with anyio.CancelScope(shield=True):  # sent for everyone in it, whatever happens to its opener
                with anyio.move_on_after(self.settings.batch_window_s):
                    await batch.sealed.wait()
                self._seal(batch)
                try:
                    await self._send(batch.items)
                except Exception as exc:  # noqa: BLE001 -- whatever it is, each waiting conversation gets it
                    error = JudgeError(str(ErrorClass.CLIENT), f"the judge could not send a batch: {exc!r}")
                    for waiting in batch.items:
                        if not waiting.done.is_set():
                            waiting.resolve(error)
        await item.done.wait()
        return item.outcome

    def _seal(self, batch: _Batch) -> None:
        if self._open is batch:
            self._open = None
        batch.sealed.set()

    async def _send(self, items: list[_Item]) -> None:
        transport = self._transport_now()
        if transport.is_batched:
            await self._send_together(items)
            return
        async with anyio.create_task_group() as group:
            for item in items:
                group.start_soon(self._send_together, [item])

    async def _send_together(self, items: list[_Item]) -> None:
        """One request for `items`; if it fails and there are several, one request each."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.settings.max_concurrent_batches)
        async with self._limiter:
            try:
                replies = await self._attempts([item.messages for item in items])
            except JudgeError as exc:
                error = exc
            else:
                for item, reply in zip(items, replies, strict=True):
                    item.resolve(reply)
                return
        if len(items) == 1:
            items[0].resolve(error)
            return
        async with anyio.create_task_group() as group:  # one conversation the server chokes on fails alone
            for item in items:
                group.start_soon(self._send_together, [item])

    async def _attempts(self, prompts: list[Messages]) -> list[str]:
        """The transport's replies, retrying retryable failures; a JudgeError once the budget is spent."""
        transport = self._transport_now()
        self._counts["num_batches"] += 1
        self._largest = max(self._largest, len(prompts))
        attempt = 0
        try:
            await transport.ready()
        except BackendError as exc:
            raise JudgeError(str(exc.error_class), exc.message) from exc
        while True:
            try:
                with anyio.fail_after(self.settings.timeout_s):
                    return await transport.complete(prompts)
            except TimeoutError:
                error = BackendError(
                    ErrorClass.TIMEOUT, f"{transport.name}: no reply within {self.settings.timeout_s:g} s"
                )
            except BackendError as exc:
                error = exc
            if error.error_class not in RETRYABLE or attempt >= self.settings.max_retries:
                note = f" (after {attempt} retries)" if attempt else ""
                raise JudgeError(str(error.error_class), error.message + note) from error
            delay = min(self.settings.backoff_max_s, self.settings.backoff_base_s * 2**attempt)
            log.info(
                "judge request failed (%s), retry %d of %d: %s",
                error.error_class,
                attempt + 1,
                self.settings.max_retries,
                error.message,
            )
            attempt += 1
            self._counts["num_retries"] += 1
            await anyio.sleep(self._rng.uniform(0.0, delay))

    def _transport_now(self) -> Transport:
        """The transport the settings name, made on first use (on the loop that uses it)."""
        if self._transport is None:
            settings = self.settings
            if not settings.url:
                self._transport = LocalTransport(settings, self._local_host or LocalModelHost(settings.local_model))
            elif settings.api == "openai":
                self._transport = OpenAITransport(settings, http_client(settings))
            else:
                tokenizer = None
                if settings.tokenizer is not None:
                    from engine.models import load_tokenizer

                    tokenizer = load_tokenizer(settings.tokenizer)
                self._transport = SGLangTransport(settings, http_client(settings), tokenizer)
        return self._transport
