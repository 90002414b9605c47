"""A request as it comes off the wire: its key, its body (bounded as it streams in), and the body read into the
API's model and the conversation a session matches (`Asked`), off the event loop where it is large. Whatever a
body holds, reading it raises RequestError (a 400 in the API's own format) and nothing else.

    key = presented_key(request)                          # x-api-key, or Authorization: Bearer
    body = await read_body(request, limits.max_body_bytes)   # RequestError 413 past the bound
    await drain(request, limits.max_body_bytes)              # or dropped, for a request refused unread
    parsed, asked = await read(api, body, limits=limits, client_sampling="ignore", retry=False)
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import anyio
import orjson
from starlette.requests import Request

from engine.agents.history import key
from engine.agents.limits import GatewayLimits, check_images, check_messages, check_tools
from engine.agents.request import RequestError
from engine.agents.session import Asked
from engine.encoding import images_of, tools_key
from engine.multimodal import BoundedCache

log = logging.getLogger(__name__)

INLINE_MAX_BYTES = 64 << 10  # a body larger than this is read in a worker thread


def presented_key(request: Request) -> str | None:
    """The API key a request presents: Anthropic's `x-api-key`, or OpenAI's `Authorization: Bearer`."""
    if given := request.headers.get("x-api-key"):
        return given
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None


def says_retry(request: Request) -> bool:
    """Whether the client says this request is a retry of one it sent (the official SDKs, and the CLIs on them,
    count their attempts in `x-stainless-retry-count`)."""
    count = request.headers.get("x-stainless-retry-count", "0")
    return count.isdigit() and int(count) > 0


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or RequestError 413 as soon as it is known to be larger than `limit` bytes (from its
    Content-Length, before any of it is read; else as it streams in)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise _too_large(declared, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"more than {size}", limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def drain(request: Request, limit: int) -> None:
    """Read the body (up to `limit` bytes) and drop it, for a request refused before it was read: a connection
    closed with a request's bytes unread in it (as a server closes it after answering a request that said
    `Connection: close`) is reset, and its client loses the answer it was sent."""
    with contextlib.suppress(RequestError):
        await read_body(request, limit)


def _too_large(size: str, limit: int) -> RequestError:
    return RequestError(
        f"the request body is {size} bytes, more than the {limit} bytes a request may send",
        status=413,
        kind="request_too_large",
        code="request_too_large",
    )


async def read(api: Any, body: bytes, **options: Any) -> tuple[Any, Asked]:
    """`read_now`, in a worker thread when the body is large (parsing it would stall every other request)."""
    if len(body) <= INLINE_MAX_BYTES:
        return read_now(api, body, **options)
    return await anyio.to_thread.run_sync(lambda: read_now(api, body, **options))


def read_now(
    api: Any,
    body: bytes,
    *,
    limits: GatewayLimits,
    client_sampling: str,
    retry: bool,
    images: bool,
    defaults: dict[str, Any] | None = None,
    decoded: BoundedCache[str, bool] | None = None,
) -> tuple[Any, Asked]:
    """The body as the API's request model and as the conversation a session matches; RequestError naming what
    is wrong, whatever the body holds. `images`: whether the policy takes images (a VLM's processor); `defaults`:
    fields a body may leave out here (a token count's `max_tokens`); `decoded`: the images earlier requests
    showed to decode (`check_images`)."""
    try:
        raw = parse_json(body)
        if defaults and isinstance(raw, dict):
            raw = {**defaults, **raw}
        parsed = api.read_request(raw, client_sampling=client_sampling)
        messages, tools = parsed.chat_messages(), parsed.chat_tools()
        if not messages:
            raise RequestError("the request holds no message the policy can read", param="messages")
        check_tools(tools, limits)
        check_messages(messages, limits)
        if not images and images_of(messages):
            raise RequestError(
                "the request holds images, but the policy takes none (no VLM processor)", param="messages"
            )
        check_images(messages, limits, decoded)
        asked = Asked(
            messages=messages,
            keys=[key(message) for message in messages],
            tools=tools,
            tools_key=tools_key(tools) if tools else None,
            cap=parsed.turn_cap,
            stop=parsed.stop_strings,
            retry=retry,
        )
    except RequestError:
        raise
    except Exception as exc:  # noqa: BLE001 -- a shape no check foresaw: still the request's fault, a 400
        log.debug("a request body did not read", exc_info=exc)
        raise RequestError(f"the request does not read as {api.NAME}: {type(exc).__name__}: {exc}") from None
    return parsed, asked


def parse_json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"the body is not JSON: {exc}") from None
