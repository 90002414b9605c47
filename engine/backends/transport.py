"""One HTTP server of SGLang's API, reached through a shared connection pool, every failure a classified
`BackendError` whose message opens with the server's name: refused / reset / closed without an answer is
CONNECTION, no answer in time TIMEOUT, HTTP 5xx SERVER, HTTP 4xx CLIENT, and a reply that is not JSON MALFORMED.
"""

from __future__ import annotations

import contextlib
import select
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpcore2
import httpx2

from engine.errors import BackendError, ErrorClass

EXCERPT_CHARS = 300


def http_transport(limits: httpx2.Limits, *, tls: bool = True) -> httpx2.AsyncHTTPTransport:
    """httpx2's transport, whose connections answer "is this idle socket readable?" with one poll. `tls`:
    False for a client of plain-http URLs only, which then builds no TLS context (34 ms a client with httpx2).

    httpx2, not httpx: httpx's pool (httpcore 1.0) rescanned every connection for each idle one on every
    request it started and every reply it ended, a third of the engine loop's time in benchmarks.longtail
    --size large; httpcore2's makes one pass. Each pass still asks every idle connection whether its socket
    is readable, and anyio's stream builds all of its attributes to answer (a getpeername call included):
    with one client per server, that was an eighth of the loop's time in benchmarks.scale's saturation run."""
    transport = httpx2.AsyncHTTPTransport(limits=limits, trust_env=False, verify=tls)
    transport._pool._network_backend = _PollingBackend()  # noqa: SLF001 -- httpx2 takes no network backend
    return transport


class _PollingBackend(httpcore2.AsyncNetworkBackend):
    """httpcore2's anyio backend, with streams that keep their raw socket."""

    def __init__(self) -> None:
        self._backend = httpcore2.AnyIOBackend()

    async def connect_tcp(self, *args: Any, **kw: Any) -> httpcore2.AsyncNetworkStream:
        return _PollingStream(await self._backend.connect_tcp(*args, **kw))

    async def connect_unix_socket(self, *args: Any, **kw: Any) -> httpcore2.AsyncNetworkStream:
        return _PollingStream(await self._backend.connect_unix_socket(*args, **kw))

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


class _PollingStream(httpcore2.AsyncNetworkStream):
    def __init__(self, stream: httpcore2.AsyncNetworkStream):
        self._stream = stream
        self._socket: socket.socket | None = stream.get_extra_info("socket")

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._stream.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._stream.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(self, *args: Any, **kw: Any) -> httpcore2.AsyncNetworkStream:
        return _PollingStream(await self._stream.start_tls(*args, **kw))

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":  # data or end of stream waiting: on an idle connection, the server closed it
            fd = -1 if self._socket is None else self._socket.fileno()
            if fd < 0:
                return True
            poll = select.poll()
            poll.register(fd, select.POLLIN)
            return bool(poll.poll(0))
        return self._socket if info == "socket" else self._stream.get_extra_info(info)


def excerpt(text: str) -> str:
    """At most `EXCERPT_CHARS` characters of a reply body, on one line."""
    text = " ".join(text.split())
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "..."


class HTTPServer:
    """`url` through `client` (shared with other servers); `name` ("SGLang server at ...") opens every error."""

    def __init__(self, client: httpx2.AsyncClient, url: str, name: str):
        self.client, self.url, self.name = client, url.rstrip("/"), name

    def __repr__(self) -> str:
        return f"HTTPServer({self.url!r})"

    def error(self, error_class: ErrorClass, where: str, detail: str, body: str | None = None) -> BackendError:
        message = f"{self.name}: {where}: {detail}"
        if body is not None:
            message += f"; reply: {excerpt(body) or '(empty)'}"
        return BackendError(error_class, message)

    async def send(self, method: str, endpoint: str, body: dict[str, Any] | None = None, **kw: Any) -> httpx2.Response:
        """Send one request; a failure to get a reply at all raises TIMEOUT, CONNECTION, CLIENT or MALFORMED."""
        try:
            return await self.client.request(method, self.url + endpoint, json=body, **kw)
        except httpx2.RequestError as exc:
            raise self.failure(f"{method} {endpoint}", exc) from exc

    @contextlib.asynccontextmanager
    async def stream(self, method: str, endpoint: str, **kw: Any) -> AsyncIterator[httpx2.Response]:
        """Send one request and hold its reply open while the body is read (`aiter_bytes`); a failure before the
        reply's head raises as `send` does. The connection is closed on leaving, read to its end or not."""
        try:
            async with self.client.stream(method, self.url + endpoint, **kw) as response:
                yield response
        except httpx2.RequestError as exc:
            raise self.failure(f"{method} {endpoint}", exc) from exc

    def failure(self, where: str, exc: httpx2.RequestError) -> BackendError:
        """The error of a request that got no reply, or lost the rest of one: TIMEOUT, CLIENT, MALFORMED or
        CONNECTION."""
        if isinstance(exc, httpx2.TimeoutException):
            return self.error(ErrorClass.TIMEOUT, where, f"no reply in time ({type(exc).__name__})")
        if isinstance(exc, httpx2.UnsupportedProtocol | httpx2.LocalProtocolError):
            return self.error(ErrorClass.CLIENT, where, f"cannot send the request: {exc!r}")
        if isinstance(exc, httpx2.DecodingError):
            return self.error(ErrorClass.MALFORMED, where, f"the reply could not be decoded: {exc!r}")
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} (connection closed)"
        return BackendError(ErrorClass.CONNECTION, f"{self.name} is unreachable: {where}: {detail}")

    def status_error(self, where: str, response: httpx2.Response) -> BackendError:
        error_class = ErrorClass.SERVER if response.status_code >= 500 else ErrorClass.CLIENT
        return self.error(error_class, where, f"HTTP {response.status_code}", response.text)

    def json(self, where: str, response: httpx2.Response) -> Any:
        try:
            return response.json()
        except ValueError as exc:
            raise self.error(ErrorClass.MALFORMED, where, "the reply is not JSON", response.text) from exc

    async def call(self, method: str, endpoint: str, body: dict[str, Any] | None = None) -> httpx2.Response:
        """Send one request and raise on any non-2xx status."""
        response = await self.send(method, endpoint, body)
        if not response.is_success:
            raise self.status_error(f"{method} {endpoint}", response)
        return response

    async def served(self, endpoint: str) -> httpx2.Response | None:
        """GET `endpoint`'s successful reply, or None where the server answers 404 (it does not serve it); any
        other failure raises as `call` does."""
        response = await self.send("GET", endpoint)
        if response.status_code == 404:
            return None
        if not response.is_success:
            raise self.status_error(f"GET {endpoint.partition('?')[0]}", response)
        return response

    async def health_status(self, timeout: httpx2.Timeout) -> int | None:
        """The HTTP status of GET /health, or None when the server cannot be reached."""
        try:
            return (await self.send("GET", "/health", timeout=timeout)).status_code
        except BackendError:
            return None
