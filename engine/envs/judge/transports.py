"""How judge prompts reach a judge model: SGLang's /generate, an OpenAI-compatible chat API, or the local model.

Each transport turns a list of judge prompts (chat messages) into the judge's reply texts, in order, and
raises a classified `BackendError` (engine/backends/transport.py) when it gets none; the judge retries and
batches around it. `is_batched` says whether one call sends the prompts together (one SGLang request
with a list, one pass of the local model) or the judge should send them one at a time (OpenAI's API
takes one conversation per request).

The local model (`LocalModelHost`) is the embedded default's LocalBackend, served on an event loop of its
own in a daemon thread, so any caller's loop (the engine's, slime's) can use it and nothing waits for it
at exit.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import anyio
import httpx2
from anyio.from_thread import BlockingPortal

from engine.backends.base import SamplingParams
from engine.backends.transport import HTTPServer
from engine.envs.judge.settings import JudgeSettings
from engine.errors import BackendError, ErrorClass

Messages = list[dict[str, str]]


class Transport(Protocol):
    name: str
    is_batched: bool

    async def ready(self) -> None:
        """Whatever must happen once before the first request (loading a local model); not timed."""

    async def complete(self, prompts: Sequence[Messages]) -> list[str]: ...

    async def aclose(self) -> None: ...


def auth_headers(settings: JudgeSettings) -> dict[str, str]:
    """The bearer token from the variable `api_key_env` names, as a header; ValueError when it is unset."""
    if not settings.api_key_env:
        return {}
    token = os.environ.get(settings.api_key_env)
    if not token:
        raise ValueError(f"judge api_key_env {settings.api_key_env!r}: that environment variable is not set")
    return {"authorization": f"Bearer {token}"}


def http_client(settings: JudgeSettings) -> httpx2.AsyncClient:
    """One connection pool for a judge. Proxy settings from the environment are ignored, as the backends do."""
    return httpx2.AsyncClient(
        timeout=httpx2.Timeout(settings.timeout_s, connect=min(settings.timeout_s, 10.0)),
        limits=httpx2.Limits(max_connections=4 * settings.max_concurrent_batches),
        headers=auth_headers(settings),
        trust_env=False,
    )


class SGLangTransport:
    """POST /generate with every prompt of a batch in one request (`text` or `input_ids` as a list)."""

    is_batched = True

    def __init__(self, settings: JudgeSettings, client: httpx2.AsyncClient, tokenizer: Any = None):
        self.name = f"judge at {settings.url}"
        self.settings, self.client, self.tokenizer = settings, client, tokenizer
        self._server = HTTPServer(client, settings.url or "", self.name)

    async def ready(self) -> None:
        pass

    async def complete(self, prompts: Sequence[Messages]) -> list[str]:
        body: dict[str, Any] = {
            "sampling_params": {
                "max_new_tokens": self.settings.max_new_tokens,
                "temperature": self.settings.temperature,
            }
        }
        if self.tokenizer is None:
            body["text"] = [prompt[-1]["content"] for prompt in prompts]
        else:
            body["input_ids"] = [render_ids(self.tokenizer, prompt) for prompt in prompts]
        where = "POST /generate"
        response = await self._server.send("POST", "/generate", body)
        if not response.is_success:
            raise self._server.status_error(where, response)
        reply = self._server.json(where, response)
        replies = reply if isinstance(reply, list) else [reply]
        texts = [item.get("text") if isinstance(item, dict) else None for item in replies]
        if len(texts) != len(prompts) or not all(isinstance(text, str) for text in texts):
            detail = f"expected {len(prompts)} replies with a text each"
            raise self._server.error(ErrorClass.MALFORMED, where, detail, response.text)
        return texts

    async def aclose(self) -> None:
        await self.client.aclose()


class OpenAITransport:
    """POST /v1/chat/completions, one conversation per request; the reply is choices[0].message.content."""

    is_batched = False

    def __init__(self, settings: JudgeSettings, client: httpx2.AsyncClient):
        self.name = f"judge at {settings.url}"
        self.settings, self.client = settings, client
        self._server = HTTPServer(client, settings.url or "", self.name)

    async def ready(self) -> None:
        pass

    async def complete(self, prompts: Sequence[Messages]) -> list[str]:
        return [await self._one(prompt) for prompt in prompts]

    async def _one(self, prompt: Messages) -> str:
        body = {
            "model": self.settings.model,
            "messages": prompt,
            "max_tokens": self.settings.max_new_tokens,
            "temperature": self.settings.temperature,
        }
        where = "POST /v1/chat/completions"
        response = await self._server.send("POST", "/v1/chat/completions", body)
        if not response.is_success:
            raise self._server.status_error(where, response)
        reply = self._server.json(where, response)
        try:
            content = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            content = None
        if not isinstance(content, str):
            raise self._server.error(ErrorClass.MALFORMED, where, "no choices[0].message.content", response.text)
        return content

    async def aclose(self) -> None:
        await self.client.aclose()


class LocalTransport:
    """The local model (`LocalModelHost`), a batch at a time; the caller's loop waits in a worker thread."""

    is_batched = True

    def __init__(self, settings: JudgeSettings, host: LocalModelHost):
        self.name = f"local judge model {settings.local_model!r}"
        self.settings, self.host = settings, host

    async def ready(self) -> None:
        await anyio.to_thread.run_sync(self.host.start)  # loads the model on first use

    async def complete(self, prompts: Sequence[Messages]) -> list[str]:
        ids = [render_ids(self.host.tokenizer, prompt) for prompt in prompts]
        params = SamplingParams(
            max_new_tokens=self.settings.max_new_tokens,
            temperature=self.settings.temperature,
            stop_token_ids=self.host.stop_token_ids,
        )
        future = self.host.portal.start_task_soon(self.host.generate_all, ids, params)
        try:
            return await anyio.to_thread.run_sync(future.result, abandon_on_cancel=True)
        finally:
            future.cancel()  # a cancelled caller: the generation stops too (a no-op once it is done)

    async def aclose(self) -> None:
        pass  # the host is shared by every judge of the process


class LocalModelHost:
    """The embedded default's LocalBackend on its own event loop, in a daemon thread started on first use."""

    def __init__(self, name: str):
        self.name = name
        self.tokenizer: Any = None
        self.stop_token_ids: tuple[int, ...] = ()
        self._backend: Any = None
        self._portal: BlockingPortal | None = None
        self._started = threading.Event()
        self._lock = threading.Lock()
        self._failure: BaseException | None = None

    @property
    def portal(self) -> BlockingPortal:
        assert self._portal is not None, "LocalModelHost.start() first"
        return self._portal

    def start(self) -> None:
        """Load the model and start serving it (once; blocks until ready). Raises BackendError(CONNECTION)."""
        with self._lock:
            if not self._started.is_set():
                threading.Thread(target=anyio.run, args=(self._serve,), name=f"judge {self.name}", daemon=True).start()
                self._started.wait()
        if self._failure is not None:
            raise BackendError(
                ErrorClass.CONNECTION, f"local judge model {self.name!r} does not load: {self._failure!r}"
            )

    async def _serve(self) -> None:
        try:
            from engine.backends.local import LocalBackend
            from engine.models import TINY_MODELS, load_model, load_tokenizer

            self.tokenizer = load_tokenizer("qwen2.5" if self.name in TINY_MODELS else self.name)
            ends = ("<|im_end|>", "<|endoftext|>")
            self.stop_token_ids = tuple(i for i in map(self.tokenizer.convert_tokens_to_ids, ends) if i is not None)
            backend = LocalBackend(load_model(self.name), self.tokenizer)
        except Exception as exc:  # noqa: BLE001 -- reported to every caller by start()
            self._failure = exc
            self._started.set()
            return
        async with backend, BlockingPortal() as portal:
            self._backend, self._portal = backend, portal
            self._started.set()
            await portal.sleep_until_stopped()

    async def generate_all(self, ids: list[list[int]], params: SamplingParams) -> list[str]:
        """Every prompt at once (the backend batches them); runs on the host's loop."""
        texts: list[str] = [""] * len(ids)

        async def one(i: int) -> None:
            texts[i] = (await self._backend.generate(ids[i], params)).text

        async with anyio.create_task_group() as group:
            for i in range(len(ids)):
                group.start_soon(one, i)
        return texts


def render_ids(tokenizer: Any, prompt: Messages) -> list[int]:
    """The prompt rendered by the tokenizer's chat template (with the generation prompt), as token ids."""
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
