"""One HTTP server of SGLang's API, reached through a shared connection pool, every failure a classified
`BackendError` whose message opens with the server's name: refused / reset / closed without an answer is
CONNECTION, no answer in time TIMEOUT, HTTP 5xx SERVER, HTTP 4xx CLIENT, and a reply that is not JSON MALFORMED.
"""

from __future__ import annotations

from typing import Any

import httpx

from engine.errors import BackendError, ErrorClass

EXCERPT_CHARS = 300


def excerpt(text: str) -> str:
    """At most `EXCERPT_CHARS` characters of a reply body, on one line."""
    text = " ".join(text.split())
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "..."


class HTTPServer:
    """`url` through `client` (shared with other servers); `name` ("SGLang server at ...") opens every error."""

    def __init__(self, client: httpx.AsyncClient, url: str, name: str):
        self.client, self.url, self.name = client, url.rstrip("/"), name

    def __repr__(self) -> str:
        return f"HTTPServer({self.url!r})"

    def error(self, error_class: ErrorClass, where: str, detail: str, body: str | None = None) -> BackendError:
        message = f"{self.name}: {where}: {detail}"
        if body is not None:
            message += f"; reply: {excerpt(body) or '(empty)'}"
        return BackendError(error_class, message)

    async def send(self, method: str, endpoint: str, body: dict[str, Any] | None = None, **kw: Any) -> httpx.Response:
        """Send one request; a failure to get a reply at all raises TIMEOUT, CONNECTION, CLIENT or MALFORMED."""
        where = f"{method} {endpoint}"
        try:
            return await self.client.request(method, self.url + endpoint, json=body, **kw)
        except httpx.TimeoutException as exc:
            raise self.error(ErrorClass.TIMEOUT, where, f"no reply in time ({type(exc).__name__})") from exc
        except (httpx.UnsupportedProtocol, httpx.LocalProtocolError) as exc:
            raise self.error(ErrorClass.CLIENT, where, f"cannot send the request: {exc!r}") from exc
        except httpx.DecodingError as exc:
            raise self.error(ErrorClass.MALFORMED, where, f"the reply could not be decoded: {exc!r}") from exc
        except httpx.RequestError as exc:
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} (connection closed)"
            raise BackendError(ErrorClass.CONNECTION, f"{self.name} is unreachable: {where}: {detail}") from exc

    def status_error(self, where: str, response: httpx.Response) -> BackendError:
        error_class = ErrorClass.SERVER if response.status_code >= 500 else ErrorClass.CLIENT
        return self.error(error_class, where, f"HTTP {response.status_code}", response.text)

    def json(self, where: str, response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError as exc:
            raise self.error(ErrorClass.MALFORMED, where, "the reply is not JSON", response.text) from exc

    async def call(self, method: str, endpoint: str, body: dict[str, Any] | None = None) -> httpx.Response:
        """Send one request and raise on any non-2xx status."""
        response = await self.send(method, endpoint, body)
        if not response.is_success:
            raise self.status_error(f"{method} {endpoint}", response)
        return response

    async def health_status(self, timeout: httpx.Timeout) -> int | None:
        """The HTTP status of GET /health, or None when the server cannot be reached."""
        try:
            return (await self.send("GET", "/health", timeout=timeout)).status_code
        except BackendError:
            return None
