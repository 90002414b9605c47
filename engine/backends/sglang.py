"""The `Backend` protocol as an HTTP client of SGLang's native API (0.5.x): one SGLang server, or an
sglang-router (PyPI `sglang-router`, 0.3.2) in front of several, as slime runs them.

Which of the two a URL is, is found on first use (`async with`, or the first control call): a router answers
`GET /workers` with its workers, a server answers 404 (engine/backends/workers.py). Through a router,
`/generate` goes to the router, so its policy applies; control calls (abort, pause, resume, weight version,
weight updates, health) go to each worker directly, as the router does not serve them (404), and the worker
list is read again for each call, so workers added later are reached. Errors are classified `BackendError`s
naming the server, the endpoint and an excerpt of the reply (engine/backends/transport.py).

An aborted request (`/abort_request`, or `/pause_generation` in mode "abort") is not an error: SGLang answers
it with HTTP 200 and what was generated so far, finish type "abort".

Streaming: given a token listener (`on_tokens`, engine/backends/base.py), a request goes with `"stream": true` and
its tokens are handed on chunk by chunk (engine/backends/sglang_stream.py says what SGLang's chunks hold and how
they are read); without one, the request is exactly the unstreamed one. A stream that breaks after tokens came
returns them as an aborted generation (`meta[STREAM_BROKEN]` says why); the read timeout then bounds the wait for
each chunk rather than the whole generation.

Aborts touch this backend's requests only. Every request id sent is `<rid_prefix><serial>-<rid>`, with a
prefix unique to the backend (`turnstile-<8 hex>-`) and a serial that makes no id a prefix of another.
SGLang 0.5.23 (`TokenizerManager.abort_request`, managers/tokenizer_manager.py) looks the rid up exactly and,
with one tokenizer worker (the default), drops an unknown one; only a known rid reaches the scheduler, which
then aborts every request whose rid starts with it (`Scheduler.abort_request`). So a prefix alone aborts
nothing, and `abort(None)` posts each of this backend's request ids in flight to each worker (a worker that
does not hold one ignores it) instead of `abort_all`, which would abort other clients' requests too.

`session_id` goes as the header `X-SMG-Routing-Key`, as slime sends it, so a trajectory's turns reach one
worker and reuse its prefix cache. Of sglang-router 0.3.2's policies two route by it (tests/test_sglang_router.py
checks both): `consistent_hashing`, a hash ring over the workers (a key moves only when its worker leaves or
turns unhealthy), and `manual`, a table of key to worker (a key stays while its worker is healthy). `random`,
`round_robin` and `power_of_two` spread one key's requests over the workers; `cache_aware` routes by prompt
prefix, not by the key. 0.3.2's `--policy` choices omit `consistent_hashing`: it is set through RouterArgs, as
slime does (tests/router.py).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import anyio
import httpx2

from engine.backends.base import GenerateResult, ReportedLoad, SamplingParams, TokenListener, notify
from engine.backends.fanout import agreed_version, combined_error, gather, log_failures
from engine.backends.sglang_format import THREAD_MIN_BYTES, JSONStrings, body_size, generate_body, parse_generate_reply
from engine.backends.sglang_read import read_turn
from engine.backends.sglang_stream import read_stream
from engine.backends.transport import HTTPServer, http_transport
from engine.backends.workers import list_workers
from engine.errors import BackendError, ErrorClass
from engine.parsers.base import ParsedTurn

PAUSE_MODES = ("abort", "retract", "in_place")
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
# SGLang's /health runs a one-token generation and waits up to 20 s for it (SGLANG_HEALTH_CHECK_TIMEOUT).
HEALTH_TIMEOUT_S = 30.0
# Image payloads as JSON, shared by every SGLangBackend (a pool's backends send the same trajectories' images).
SHARED_JSON_STRINGS = JSONStrings()
T = TypeVar("T")


class SGLangBackend:
    """An SGLang server or an sglang-router over HTTP, through one connection pool; see the module docstring.

        async with SGLangBackend("http://10.0.0.5:30000", timeout=300) as backend:
            await backend.wait_until_healthy(timeout=120)
            result = await backend.generate(prompt_ids, SamplingParams(max_new_tokens=512), session_id=sid)

    `timeout` bounds each wait on a server (for a pooled connection, a write, a read); SGLang sends a
    non-streamed reply in one piece, so it bounds a whole generation. `connect_timeout` bounds the TCP
    connect. `headers` go with every request, to the router and its workers (an API key). Proxy settings from
    the environment are ignored: servers are addressed directly. `rid_prefix` starts every request id sent;
    `is_router` is None until found out. `json_strings` keeps each image payload's JSON (default: one cache shared
    by all backends); `transport` replaces httpx2's (an httpx2.MockTransport in tests and benchmarks).

    A request body is built off the event loop when it is large (images or a long prompt; see
    engine/backends/sglang_format.py) and sent as bytes. The backend streams (engine/backends/base.py): given a
    listener, a request is sent with `"stream": true`.
    """

    streams = True
    token_buffers = True  # input_ids as an array is copied and serialised without a loop over its ids

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        max_connections: int = 1024,
        headers: dict[str, str] | None = None,
        image_token_id: int | None = None,
        json_strings: JSONStrings | None = None,
        transport: httpx2.AsyncBaseTransport | None = None,
    ):
        self.url = url.rstrip("/")
        self.image_token_id = image_token_id
        self.rid_prefix = f"turnstile-{uuid.uuid4().hex[:8]}-"
        self.is_router: bool | None = None
        self._json_strings = SHARED_JSON_STRINGS if json_strings is None else json_strings
        limits = httpx2.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._client = httpx2.AsyncClient(
            timeout=httpx2.Timeout(timeout, connect=connect_timeout),
            headers=headers,
            trust_env=False,
            transport=transport or http_transport(limits, tls=self.url.startswith("https:")),
        )
        self._health_timeout = httpx2.Timeout(min(timeout, HEALTH_TIMEOUT_S), connect=connect_timeout)
        self._server = HTTPServer(self._client, self.url, f"SGLang server at {self.url}")
        self._workers: dict[str, HTTPServer] = {}
        self._serial = itertools.count()
        self._running: dict[str, str | None] = {}  # request id sent -> the caller's rid
        self._building: set[str] = set()  # request ids whose body a worker thread is building: not sent yet
        self._aborted_unsent: set[str] = set()  # of those, the ones aborted meanwhile: they are never sent

    async def __aenter__(self) -> SGLangBackend:
        """Find out whether the URL is a server or a router (with workers); BackendError, closed, if neither."""
        try:
            await self._control_servers()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool; the backend cannot be used afterwards."""
        await self._client.aclose()

    def __repr__(self) -> str:
        return f"SGLangBackend({self.url!r})"

    # -- where control calls go ------------------------------------------------------------------

    async def _control_servers(self) -> list[HTTPServer]:
        """The server itself, or each worker the router lists now."""
        if self.is_router is False:
            return [self._server]
        urls = await list_workers(self._server)
        self.is_router = urls is not None
        if urls is None:
            return [self._server]
        self._server.name = f"sglang-router at {self.url}"
        for url in urls:
            if url not in self._workers:
                name = f"SGLang server at {url} (a worker of sglang-router at {self.url})"
                self._workers[url] = HTTPServer(self._client, url, name)
        return [self._workers[url] for url in urls]

    async def worker_urls(self) -> list[str]:
        """The URLs of the router's workers as it lists them now; the server's own, when this is a server."""
        return [server.url for server in await self._control_servers()]

    async def read_turn(
        self, text: str, *, tools: list[dict[str, Any]], tool_call_parser: str | None, reasoning_parser: str | None
    ) -> ParsedTurn:
        """A turn's text as SGLang's own parsers read it (engine/backends/sglang_read.py): on the server, or on
        the router's workers in turn (sglang-router does not route the parsing endpoints)."""
        if self.is_router is False:
            servers = [self._server]
        else:  # the workers listed last (each control call lists them anew)
            servers = list(self._workers.values()) or await self._control_servers()
        if not servers:
            raise self._server.error(ErrorClass.SERVER, "POST /parse_function_call", "the router lists no workers")
        server = servers[next(self._serial) % len(servers)]
        return await read_turn(
            server, text, tools=tools, tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser
        )

    async def _each(
        self, what: str, call: Callable[[HTTPServer], Awaitable[T]], *, strict: bool = False
    ) -> dict[str, T]:
        """`call` on the server, or on every worker at once; results by URL. A worker that fails is logged; one
        BackendError, naming each failure, is raised when all failed (any, with `strict`)."""
        servers = await self._control_servers()
        results, failures = await gather({s.url: partial(call, s) for s in servers})
        if failures and len(servers) == 1:
            raise next(iter(failures.values()))
        log_failures(what, failures)
        if failures and (strict or not results):
            raise combined_error(f"{what} on the workers of sglang-router at {self.url}", failures, len(servers))
        return results

    # -- the protocol ----------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams,
        image_data: Sequence[str] | None = None,
        *,
        rid: str | None = None,
        session_id: str | None = None,
        on_tokens: TokenListener | None = None,
    ) -> GenerateResult:
        """POST /generate with `input_ids` (and `image_data` when given), log-probs on, under a request id of this
        backend's (see the module docstring) and, with `session_id`, the routing key header. With `on_tokens`, the
        reply is streamed and each chunk's new tokens go to it as they arrive (`_stream`); without, the request is
        not streamed.

        With images, SGLang expands each image's placeholder itself and takes one image pad per image
        (0.5.23 never answers a request whose pads are already expanded). Given `image_token_id`, each
        run of it is sent as one pad, and the server's `prompt_tokens` must equal `len(input_ids)`: the
        positions the model sees are the ones the trajectory records, or a CLIENT error says otherwise.

        `input_ids` may also be an integer buffer (a trajectory's `array("i")` tokens, an ndarray): it is copied
        and serialised without a Python loop over its ids, which is faster than a list with images.
        """
        sent_rid = f"{self.rid_prefix}{next(self._serial)}-{rid or ''}"
        build = partial(
            generate_body,
            input_ids,
            sampling_params.to_sglang(),
            sent_rid,
            None if image_data is None else list(image_data),
            image_token_id=self.image_token_id,
            strings=self._json_strings,
            stream=on_tokens is not None,
        )
        headers = {"content-type": "application/json"}
        if session_id is not None:
            headers[ROUTING_KEY_HEADER] = session_id
        self._running[sent_rid] = rid
        try:
            built = await self._build(sent_rid, build, body_size(input_ids, image_data))
            if built is None:  # aborted before it was sent: as SGLang answers one still queued
                return GenerateResult(token_ids=[], logprobs=[], text="", finish_reason="abort")
            body, num_sent = built
            check = partial(self._check_prompt, num_sent, len(input_ids), len(image_data or ()))
            if on_tokens is not None:
                return await self._stream(body, headers, check, on_tokens)
            response = await self._server.send("POST", "/generate", content=body, headers=headers)
        finally:
            del self._running[sent_rid]
            self._aborted_unsent.discard(sent_rid)
        result = self._reply(response)
        check(result.prompt_tokens, result.finish_reason)
        return result

    async def _build(
        self, sent_rid: str, build: Callable[[], tuple[bytes, int]], size: int
    ) -> tuple[bytes, int] | None:
        """The request body and how many prompt tokens it sends, built in a worker thread when large; None when the
        request was aborted meanwhile (it is never sent)."""
        if size < THREAD_MIN_BYTES:
            return build()
        self._building.add(sent_rid)
        try:
            built = await anyio.to_thread.run_sync(build)
        finally:
            self._building.discard(sent_rid)
        return None if sent_rid in self._aborted_unsent else built

    def _reply(self, response: httpx2.Response) -> GenerateResult:
        """A whole /generate reply as a result, or the error it is."""
        where = "POST /generate"
        if not response.is_success:
            # Only a reply that is itself a generate reply ending in abort is an abort; anything else
            # (SGLang's {"object": "error", ...} bodies included) is the error its status says.
            try:
                result = parse_generate_reply(response.json())
            except ValueError:
                raise self._server.status_error(where, response) from None
            if result.finish_reason != "abort":
                raise self._server.status_error(where, response)
            return result
        try:
            return parse_generate_reply(self._server.json(where, response))
        except ValueError as exc:
            raise self._server.error(ErrorClass.MALFORMED, where, str(exc), response.text) from exc

    def _check_prompt(self, num_sent: int, num_ids: int, num_images: int, prompt_tokens: Any, finish: Any) -> None:
        """CLIENT error when the server's prompt, its images expanded, is not the encoder's (see `generate`)."""
        if num_sent != num_ids and finish != "abort" and prompt_tokens != num_ids:
            detail = (
                f"the server expanded {num_images} image(s) into a prompt of {prompt_tokens} tokens, the encoder "
                f"into {num_ids}: its image processor settings differ from the encoder's"
            )
            raise self._server.error(ErrorClass.CLIENT, "POST /generate", detail)

    async def _stream(
        self, body: bytes, headers: dict[str, str], check: Callable[[Any, Any], None], on_tokens: TokenListener
    ) -> GenerateResult:
        """POST /generate streamed (engine/backends/sglang_stream.py `read_stream`); a reply that is not a stream (an
        error status, a server that does not stream) is read whole, its tokens handed over at once."""
        async with self._server.stream("POST", "/generate", content=body, headers=headers) as response:
            if not (response.is_success and response.headers.get("content-type", "").startswith("text/event-stream")):
                await response.aread()
                result = self._reply(response)
                check(result.prompt_tokens, result.finish_reason)
                notify(on_tokens, result.token_ids)
                return result
            return await read_stream(self._server, response, check, on_tokens)

    async def abort(self, rid: str | None = None) -> None:
        """POST /abort_request, to each worker, for this backend's request `rid`, or for each of its requests in
        flight when `rid` is None; other clients' requests are left alone. Nothing in flight: nothing sent. A
        request whose body is still being built is not sent at all: it returns at once, finish_reason `abort`."""
        rids = [sent for sent, asked in self._running.items() if rid is None or asked == rid]
        self._aborted_unsent.update(r for r in rids if r in self._building)  # those are never sent
        rids = [r for r in rids if r not in self._building]
        if rids:
            await self._each("POST /abort_request", partial(self._abort_on, rids=rids))

    @staticmethod
    async def _abort_on(server: HTTPServer, rids: list[str]) -> None:
        calls = {r: partial(server.call, "POST", "/abort_request", {"rid": r}) for r in rids}
        _, failures = await gather(calls)
        if failures:
            raise next(iter(failures.values()))

    async def pause(self, mode: str = "in_place") -> None:
        """POST /pause_generation to each worker. "in_place" keeps requests and their KV cache until `resume`;
        "retract" puts running requests back in the queue; "abort" aborts every request on the server, other
        clients' too (they return with finish_reason "abort")."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._each("POST /pause_generation", lambda s: s.call("POST", "/pause_generation", {"mode": mode}))

    async def resume(self) -> None:
        """POST /continue_generation to each worker: paused requests carry on."""
        await self._each("POST /continue_generation", lambda s: s.call("POST", "/continue_generation", {}))

    async def weight_version(self) -> str | None:
        """GET /model_info's `weight_version` (SGLang 0.5.x serves it there; there is no /get_weight_version),
        of the server or of each worker. Workers that disagree (mid-update, or after an update that failed on
        some) give the version most of them report, the first listed on a tie, with a warning naming each
        worker's version; workers that cannot be reached are logged and left out."""
        versions = await self._each("GET /model_info", self._weight_version_of)
        return agreed_version(versions)

    async def reported_loads(self) -> list[ReportedLoad] | None:
        """What the server, or each worker of the router, reports it runs (`GET /v1/loads`, SGLang 0.5.x); None
        where a server does not serve it (an older SGLang answers 404). Workers that fail are left out."""
        loads = list((await self._each("GET /v1/loads", self._load_of)).values())
        return None if None in loads else loads

    @staticmethod
    async def _load_of(server: HTTPServer) -> ReportedLoad | None:
        where = "GET /v1/loads"
        response = await server.served("/v1/loads?include=core")
        if response is None:
            return None
        reply = server.json(where, response)
        ranks = reply.get("loads") if isinstance(reply, dict) else None
        try:
            return ReportedLoad(
                running=sum(int(rank["num_running_reqs"]) for rank in ranks),
                waiting=sum(int(rank["num_waiting_reqs"]) for rank in ranks),
                max_running=sum(int(rank["max_running_requests"]) for rank in ranks),
                token_usage=max((float(rank.get("token_usage", 0.0)) for rank in ranks), default=0.0),
                used_tokens=sum(int(rank.get("num_used_tokens", 0)) for rank in ranks),
            )
        except (TypeError, KeyError, ValueError) as exc:
            raise server.error(ErrorClass.MALFORMED, where, f"no load per rank ({exc!r})", str(reply)[:500]) from exc

    @staticmethod
    async def _weight_version_of(server: HTTPServer) -> str | None:
        where = "GET /model_info"
        reply = server.json(where, await server.call("GET", "/model_info"))
        if not isinstance(reply, dict) or "weight_version" not in reply:
            raise server.error(ErrorClass.MALFORMED, where, "no weight_version in the reply", str(reply))
        version = reply["weight_version"]
        return None if version is None else str(version)

    async def _health_status(self) -> int | None:
        """GET /health's status: the server's, or 200 when any worker answers 200 (else the first answer); None
        when nothing can be reached."""
        try:
            servers = await self._control_servers()
        except BackendError:
            return None
        statuses, _ = await gather({s.url: partial(s.health_status, self._health_timeout) for s in servers})
        answers = [status for status in statuses.values() if status is not None]
        return 200 if 200 in answers else next(iter(answers), None)

    async def health(self) -> bool:
        """True when the server, or any worker of the router, answers GET /health with 200. Never raises."""
        return await self._health_status() == 200

    async def health_problem(self) -> str | None:
        """None when healthy (as `health`), else what GET /health answered, in words to act on. Never raises."""
        status = await self._health_status()
        if status == 200:
            return None
        if status is None:
            return f"GET /health: {self.url} cannot be reached"
        why = {
            404: f"nothing at {self.url} serves SGLang's API (an SGLang server or an sglang-router answers 200)",
            503: "the server is starting (loading its model) or has no healthy worker; try once it answers 200",
        }.get(status, "not 200")
        return f"GET /health answered HTTP {status}: {why}"

    async def wait_until_healthy(self, timeout: float, *, poll_interval: float = 0.5) -> None:
        """Poll /health until it answers 200 (SGLang answers 503 while starting); CONNECTION error at the deadline."""
        last: int | None = None
        with anyio.move_on_after(timeout):
            while (last := await self._health_status()) != 200:
                await anyio.sleep(poll_interval)
            return
        seen = "never reachable" if last is None else f"last answer HTTP {last}"
        raise self._server.error(ErrorClass.CONNECTION, "GET /health", f"not healthy within {timeout:g} s ({seen})")

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> dict[str, Any]:
        """POST /update_weights_from_disk to each worker; returns SGLang's reply (`success`, `message`,
        `num_paused_requests`), the first worker's. A refused update (`success: false`, which SGLang sends with
        HTTP 400) raises CLIENT. A failure on any worker raises (one error naming each failed worker), as the
        workers' weights would then differ."""
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = weight_version

        async def update(server: HTTPServer) -> dict[str, Any]:
            where = "POST /update_weights_from_disk"
            reply = server.json(where, await server.call("POST", "/update_weights_from_disk", body))
            if not isinstance(reply, dict) or not isinstance(reply.get("success"), bool):
                raise server.error(ErrorClass.MALFORMED, where, "no success flag in the reply", str(reply))
            if not reply["success"]:
                raise server.error(ErrorClass.CLIENT, where, "the server refused the update", str(reply.get("message")))
            return reply

        replies = await self._each("POST /update_weights_from_disk", update, strict=True)
        return next(iter(replies.values()))
