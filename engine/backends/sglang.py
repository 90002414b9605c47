"""The `Backend` protocol as an HTTP client of a running SGLang server (its native API, 0.5.x).

Every failure is raised as a classified `BackendError` whose message names the server, the endpoint
and, where the server answered, an excerpt of its reply: refused / reset / closed without an answer is
CONNECTION, no answer in time TIMEOUT, HTTP 5xx SERVER, HTTP 4xx CLIENT, and a reply that is not JSON
or not in SGLang's shape MALFORMED.

An aborted request (`/abort_request`, or `/pause_generation` in mode "abort") is not an error: SGLang
answers it with HTTP 200 and what was generated so far, finish type "abort". SGLang matches `rid` as a
prefix when aborting, so request ids should not be prefixes of one another (uuids are safe).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import httpx

from engine.backends.base import GenerateResult, SamplingParams
from engine.errors import BackendError, ErrorClass

FINISH_TYPES = ("stop", "length", "abort")
PAUSE_MODES = ("abort", "retract", "in_place")
# SGLang's /health runs a one-token generation and waits up to 20 s for it (SGLANG_HEALTH_CHECK_TIMEOUT).
HEALTH_TIMEOUT_S = 30.0
EXCERPT_CHARS = 300


def _excerpt(text: str) -> str:
    """At most `EXCERPT_CHARS` characters of a reply body, on one line."""
    text = " ".join(text.split())
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "..."


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_generate_reply(body: Any) -> GenerateResult:
    """Turn a `/generate` reply (with `return_logprob`) into a GenerateResult; ValueError names what is wrong.

    Tokens and log-probs come from `meta_info.output_token_logprobs` (`[[logprob, token_id, text], ...]`).
    A request aborted while still queued may come back without counts or log-probs: that is zero tokens.
    """
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ValueError("the reply has no meta_info object")
    meta = body["meta_info"]
    finish = meta.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, dict) else None
    if finish_type not in FINISH_TYPES:
        raise ValueError(f"unknown finish_reason {finish!r}")
    is_abort = finish_type == "abort"

    entries = meta.get("output_token_logprobs", [] if is_abort else None)
    if not isinstance(entries, list):
        raise ValueError("meta_info.output_token_logprobs is missing (was return_logprob sent?)")
    token_ids: list[int] = []
    logprobs: list[float] = []
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) >= 2 and _number(entry[0]) and type(entry[1]) is int):
            raise ValueError(f"bad output_token_logprobs entry {entry!r}")
        logprobs.append(float(entry[0]))
        token_ids.append(entry[1])
    output_ids = body.get("output_ids")
    if output_ids is not None and (not isinstance(output_ids, list) or len(output_ids) != len(token_ids)):
        count = len(output_ids) if isinstance(output_ids, list) else output_ids
        raise ValueError(f"output_ids has {count} tokens but output_token_logprobs has {len(token_ids)}")

    text = body.get("text", "" if is_abort else None)
    if not isinstance(text, str):
        raise ValueError("the reply has no text")
    counts: dict[str, Any] = {}
    for key in ("prompt_tokens", "cached_tokens"):
        counts[key] = meta.get(key, 0 if is_abort else None)
        if type(counts[key]) is not int:
            raise ValueError(f"meta_info.{key} is missing or not an integer")
    weight_version = meta.get("weight_version")
    return GenerateResult(
        token_ids=token_ids,
        logprobs=logprobs,
        text=text,
        finish_reason=finish_type,
        weight_version=None if weight_version is None else str(weight_version),
        meta={key: value for key, value in meta.items() if not key.endswith("_logprobs")},
        **counts,
    )


def collapse_image_pads(input_ids: list[int], image_token_id: int) -> list[int]:
    """`input_ids` with every run of `image_token_id` cut to one token."""
    return [t for i, t in enumerate(input_ids) if t != image_token_id or i == 0 or input_ids[i - 1] != image_token_id]


class SGLangBackend:
    """One SGLang server over HTTP, through one connection pool; see the module docstring.

        async with SGLangBackend("http://10.0.0.5:30000", timeout=300) as backend:
            await backend.wait_until_healthy(timeout=120)
            result = await backend.generate(prompt_ids, SamplingParams(max_new_tokens=512), rid=uuid4().hex)

    `timeout` bounds each wait on the server (for a pooled connection, a write, a read); SGLang sends a
    non-streamed reply in one piece, so it bounds a whole generation. `connect_timeout` bounds the TCP
    connect. `headers` go with every request (an API key, a router's routing key). Proxy settings from the
    environment are ignored: the server is addressed directly.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        max_connections: int = 1024,
        headers: dict[str, str] | None = None,
        image_token_id: int | None = None,
    ):
        self.url = url.rstrip("/")
        self.image_token_id = image_token_id
        self._client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            headers=headers,
            trust_env=False,
        )
        self._health_timeout = httpx.Timeout(min(timeout, HEALTH_TIMEOUT_S), connect=connect_timeout)

    async def __aenter__(self) -> SGLangBackend:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool; the backend cannot be used afterwards."""
        await self._client.aclose()

    def __repr__(self) -> str:
        return f"SGLangBackend({self.url!r})"

    # -- transport -------------------------------------------------------------------------------

    def _error(self, error_class: ErrorClass, where: str, detail: str, body: str | None = None) -> BackendError:
        message = f"SGLang server at {self.url}: {where}: {detail}"
        if body is not None:
            message += f"; reply: {_excerpt(body) or '(empty)'}"
        return BackendError(error_class, message)

    async def _send(self, method: str, endpoint: str, body: dict[str, Any] | None = None, **kw: Any) -> httpx.Response:
        """Send one request; a failure to get a reply at all raises TIMEOUT, CONNECTION, CLIENT or MALFORMED."""
        where = f"{method} {endpoint}"
        try:
            return await self._client.request(method, endpoint, json=body, **kw)
        except httpx.TimeoutException as exc:
            raise self._error(ErrorClass.TIMEOUT, where, f"no reply in time ({type(exc).__name__})") from exc
        except (httpx.UnsupportedProtocol, httpx.LocalProtocolError) as exc:
            raise self._error(ErrorClass.CLIENT, where, f"cannot send the request: {exc!r}") from exc
        except httpx.DecodingError as exc:
            raise self._error(ErrorClass.MALFORMED, where, f"the reply could not be decoded: {exc!r}") from exc
        except httpx.RequestError as exc:
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} (connection closed)"
            message = f"SGLang server at {self.url} is unreachable: {where}: {detail}"
            raise BackendError(ErrorClass.CONNECTION, message) from exc

    def _status_error(self, where: str, response: httpx.Response) -> BackendError:
        error_class = ErrorClass.SERVER if response.status_code >= 500 else ErrorClass.CLIENT
        return self._error(error_class, where, f"HTTP {response.status_code}", response.text)

    def _json(self, where: str, response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError as exc:
            raise self._error(ErrorClass.MALFORMED, where, "the reply is not JSON", response.text) from exc

    async def _call(self, method: str, endpoint: str, body: dict[str, Any] | None = None) -> httpx.Response:
        """Send one request and raise on any non-2xx status."""
        response = await self._send(method, endpoint, body)
        if not response.is_success:
            raise self._status_error(f"{method} {endpoint}", response)
        return response

    # -- the protocol ----------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams,
        image_data: Sequence[str] | None = None,
        *,
        rid: str | None = None,
    ) -> GenerateResult:
        """POST /generate with `input_ids` (and `image_data`, `rid` when given), log-probs on.

        With images, SGLang expands each image's placeholder itself and takes one image pad per image
        (0.5.23 never answers a request whose pads are already expanded). Given `image_token_id`, each
        run of it is sent as one pad, and the server's `prompt_tokens` must equal `len(input_ids)`: the
        positions the model sees are the ones the trajectory records, or a CLIENT error says otherwise.
        """
        sent = list(input_ids)
        if image_data and self.image_token_id is not None:
            sent = collapse_image_pads(sent, self.image_token_id)
        body: dict[str, Any] = {
            "input_ids": sent,
            "sampling_params": sampling_params.to_sglang(),
            "return_logprob": True,
        }
        if image_data is not None:
            body["image_data"] = list(image_data)
        if rid is not None:
            body["rid"] = rid
        where = "POST /generate"
        response = await self._send("POST", "/generate", body)
        if not response.is_success:
            # Only a reply that is itself a generate reply ending in abort is an abort; anything else
            # (SGLang's {"object": "error", ...} bodies included) is the error its status says.
            try:
                result = parse_generate_reply(response.json())
            except ValueError:
                raise self._status_error(where, response) from None
            if result.finish_reason != "abort":
                raise self._status_error(where, response)
            return result
        try:
            result = parse_generate_reply(self._json(where, response))
        except ValueError as exc:
            raise self._error(ErrorClass.MALFORMED, where, str(exc), response.text) from exc
        if len(sent) != len(input_ids) and result.finish_reason != "abort" and result.prompt_tokens != len(input_ids):
            detail = (
                f"the server expanded {len(image_data or ())} image(s) into a prompt of {result.prompt_tokens} "
                f"tokens, the encoder into {len(input_ids)}: its image processor settings differ from the encoder's"
            )
            raise self._error(ErrorClass.CLIENT, where, detail)
        return result

    async def abort(self, rid: str | None = None) -> None:
        """POST /abort_request for one request id, or for every request when `rid` is None."""
        await self._call("POST", "/abort_request", {"abort_all": True} if rid is None else {"rid": rid})

    async def pause(self, mode: str = "in_place") -> None:
        """POST /pause_generation. "in_place" keeps requests and their KV cache until `resume`;
        "retract" puts running requests back in the queue; "abort" aborts them all (they return with
        finish_reason "abort")."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        """POST /continue_generation: paused requests carry on."""
        await self._call("POST", "/continue_generation", {})

    async def weight_version(self) -> str | None:
        """GET /model_info's `weight_version`: the version of the weights the server generates with
        (SGLang 0.5.x serves it there; there is no /get_weight_version)."""
        where = "GET /model_info"
        reply = self._json(where, await self._call("GET", "/model_info"))
        if not isinstance(reply, dict) or "weight_version" not in reply:
            raise self._error(ErrorClass.MALFORMED, where, "no weight_version in the reply", str(reply))
        version = reply["weight_version"]
        return None if version is None else str(version)

    async def _health_status(self) -> int | None:
        """The HTTP status of GET /health, or None when the server cannot be reached."""
        try:
            return (await self._send("GET", "/health", timeout=self._health_timeout)).status_code
        except BackendError:
            return None

    async def health(self) -> bool:
        """GET /health: True on HTTP 200; False on any other status or when unreachable. Never raises."""
        return await self._health_status() == 200

    async def wait_until_healthy(self, timeout: float, *, poll_interval: float = 0.5) -> None:
        """Poll /health until it answers 200 (SGLang answers 503 while starting); CONNECTION error at the deadline."""
        last: int | None = None
        with anyio.move_on_after(timeout):
            while (last := await self._health_status()) != 200:
                await anyio.sleep(poll_interval)
            return
        seen = "never reachable" if last is None else f"last answer HTTP {last}"
        raise self._error(ErrorClass.CONNECTION, "GET /health", f"not healthy within {timeout:g} s ({seen})")

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> dict[str, Any]:
        """POST /update_weights_from_disk; returns SGLang's reply (`success`, `message`, `num_paused_requests`).
        A refused update (`success: false`, which SGLang sends with HTTP 400) raises CLIENT."""
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = weight_version
        where = "POST /update_weights_from_disk"
        reply = self._json(where, await self._call("POST", "/update_weights_from_disk", body))
        if not isinstance(reply, dict) or not isinstance(reply.get("success"), bool):
            raise self._error(ErrorClass.MALFORMED, where, "no success flag in the reply", str(reply))
        if not reply["success"]:
            raise self._error(ErrorClass.CLIENT, where, "the server refused the update", str(reply.get("message")))
        return reply
