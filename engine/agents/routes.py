"""The session gateway's HTTP side: its routes, who may reach which session (a key), and each request of an API
read, handed to the gateway for its turn, and answered whole or as a stream of server-sent events.

    app = Starlette(routes=GatewayHttp(gateway).routes())

Routes: the three APIs under `/sessions/<id>/v1/` (engine/agents/gateway.py's APIS), Anthropic's token count,
`POST /sessions` (a new session and its key), `POST /sessions/<id>/finish`, `GET /metrics`, and an API-format 404
for anything else. A 4xx says `x-should-retry: false`.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.agents import anthropic_messages, openai_chat, openai_responses
from engine.agents.answer import Answer
from engine.agents.request import RequestError
from engine.agents.session import Session
from engine.agents.wire import drain, presented_key, read, read_body, says_retry

log = logging.getLogger(__name__)

STREAM_PING_S = 10.0  # a streamed reply with nothing new this long sends a keep-alive (a client's idle timeout)
APIS = {api.PATH: api for api in (openai_chat, openai_responses, anthropic_messages)}  # under /sessions/<id>/v1/


class GatewayHttp:
    """The routes of one gateway (engine/agents/gateway.py, which builds them: typed loosely here, so that this
    module does not import the one that imports it)."""

    def __init__(self, gateway: Any):
        self.gateway = gateway

    def routes(self) -> list[Route]:
        return [
            *(
                Route(f"/sessions/{{session_id}}/v1/{path}", self._endpoint(api), methods=["POST"])
                for path, api in APIS.items()
            ),
            Route("/sessions/{session_id}/v1/messages/count_tokens", self._count_tokens, methods=["POST"]),
            Route("/sessions/{session_id}/finish", self._finish, methods=["POST"]),
            Route("/sessions", self._open, methods=["POST"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/{path:path}", self._unknown, methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"]),
        ]

    async def _metrics(self, request: Request) -> Response:
        """The gateway's own series in Prometheus' text format; the turns' series are the engine's."""
        return Response(generate_latest(self.gateway.registry), media_type=CONTENT_TYPE_LATEST)

    async def _open(self, request: Request) -> Response:
        """`POST /sessions` with the gateway's key: a new session, its key and its base URLs."""
        if not self._is_own_key(presented_key(request)):
            return _error(_bad_key().body(), 401)
        session = self.gateway.open_session()
        urls = {
            "openai_base_url": self.gateway.base_url(session),
            "anthropic_base_url": self.gateway.base_url(session, "anthropic"),
        }
        return JSONResponse({"id": session.id, "key": session.key, **urls})

    async def _finish(self, request: Request) -> Response:
        """`POST /sessions/<id>/finish` with its key (or the gateway's): the session finished, its chains counted."""
        try:
            session = await self._session(request)
        except RequestError as error:
            return _error(error.body(), error.status)
        chains = await self.gateway.finish_session(session)
        statuses = Counter(str(trajectory.status) for trajectory in chains)
        forks = {str(cause): n for cause, n in session.forks.items()}
        return JSONResponse({"id": session.id, "chains": len(chains), "statuses": statuses, "forks": forks})

    async def _count_tokens(self, request: Request) -> Response:
        """Anthropic's `POST /v1/messages/count_tokens`: the prompt's tokens as the policy's template renders them."""
        try:
            await self._session(request, "messages/count_tokens")
            body = await read_body(request, self.gateway.limits.max_body_bytes)
            _, asked = await read(
                anthropic_messages, body, limits=self.gateway.limits, client_sampling="ignore", retry=False,
                images=self.gateway.scheduler.encoder.processor is not None, defaults={"max_tokens": 1},
            )  # fmt: skip
            encoded = await self.gateway.encoder_for(asked).aencode_prompt(asked.messages)
        except RequestError as error:
            self.gateway.counts[f"bad_requests:{error.status}"] += 1
            return _error(anthropic_messages.error_body(error), error.status)
        except Exception as exc:  # noqa: BLE001 -- a template that does not render these messages: the request's
            self.gateway.counts["bad_requests:400"] += 1
            error = RequestError(f"the prompt does not render: {exc!r}")
            return _error(anthropic_messages.error_body(error), 400)
        return JSONResponse({"input_tokens": len(encoded.token_ids)})

    async def _unknown(self, request: Request) -> Response:
        """A path the gateway does not serve: 404 in the envelope both SDKs read (`error.message`)."""
        self.gateway.counts["bad_requests:404"] += 1
        error = RequestError(f"no such route: {request.method} {request.url.path}", status=404, kind="not_found_error")
        return _error(anthropic_messages.error_body(error), 404)

    def _is_own_key(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.gateway.key.encode())

    async def _session(self, request: Request, api: str | None = None) -> Session:
        """The session a request is for, once its key is the session's or the gateway's (counted by `api`). A
        request turned away is read to its end first (up to the body bound), so the answer reaches its client."""
        try:
            return self._session_now(request, api)
        except RequestError:
            await drain(request, self.gateway.limits.max_body_bytes)
            raise

    def _session_now(self, request: Request, api: str | None) -> Session:
        if api is not None:
            self.gateway.counts[f"requests:{api}"] += 1
        given, session_id = presented_key(request), request.path_params["session_id"]
        session = self.gateway.sessions.get(session_id)
        own = self._is_own_key(given)
        if not own and not (
            session is not None and given and hmac.compare_digest(given.encode(), session.key.encode())
        ):
            raise _bad_key()
        if session is None and own and self.gateway.open_on_first_use and len(session_id) <= 128:
            session = self.gateway.open_session(session_id)
        if session is None:
            raise RequestError(f"no open session {session_id!r}", status=404, kind="not_found_error")
        session.last_request_at = time.monotonic()
        return session

    def _endpoint(self, api: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                return await self._serve(request, api)
            except RequestError as error:
                self.gateway.counts[f"bad_requests:{error.status}"] += 1
                return _error(api.error_body(error), error.status)
            except ClientDisconnect:  # gone before its body arrived: nothing to answer, nothing started
                self.gateway.counts["disconnects"] += 1
                return Response(status_code=499)
            except Exception as exc:  # noqa: BLE001 -- a bug: this request's 500, never the gateway's end
                log.error("a %s request failed unexpectedly", api.NAME, exc_info=exc)
                self.gateway.counts["internal_errors"] += 1
                error = RequestError(f"the gateway failed: {exc!r}", status=500, kind="server_error")
                return _error(api.error_body(error), 500)

        return endpoint

    async def _serve(self, request: Request, api: Any) -> Response:
        """One request of an API (a dialect module): read, routed to its chain, answered whole or streamed."""
        gateway = self.gateway
        session = await self._session(request, api.PATH)
        body = await read_body(request, gateway.limits.max_body_bytes)
        parsed, asked = await read(
            api, body, limits=gateway.limits, client_sampling=gateway.client_sampling, retry=says_retry(request),
            images=gateway.scheduler.encoder.processor is not None, decoded=gateway.decoded_images,
        )  # fmt: skip
        for name in parsed.sampling_asked():
            self.gateway.counts[f"sampling_ignored:{name}"] += 1
        for kind, n in parsed.degraded().items():
            self.gateway.counts[f"degraded:{kind}"] += n
        answer = self.gateway.ask(session, asked, live=parsed.stream)
        model = parsed.model or self.gateway.model_name
        if not parsed.stream:
            await answer.done.wait()
            if answer.error is not None:
                raise answer.error
            if not await request.is_disconnected():  # a client gone meanwhile (its timeout) never gets this reply
                answer.deliver()
            return Response(api.reply(parsed, model, answer.message, answer.info), media_type="application/json")
        with anyio.move_on_after(STREAM_PING_S):  # the first piece, or the end: an error before any is a status
            await answer.started()
        if answer.error is not None and not answer.pieces:
            raise answer.error
        return StreamingResponse(self._events(api.Stream(parsed, model), answer), media_type="text/event-stream")

    async def _events(self, stream: Any, answer: Answer) -> AsyncIterator[str]:
        """The answer as server-sent events, each piece as it arrives, a keep-alive when none has for a while."""
        sent = 0
        try:
            yield stream.start(answer.prompt_tokens)
            while True:
                for piece in answer.pieces[sent:]:
                    yield stream.piece(*piece)
                sent = len(answer.pieces)
                if answer.done.is_set():
                    break
                with anyio.move_on_after(STREAM_PING_S) as idle:
                    await answer.changed()
                if idle.cancelled_caught:
                    yield stream.ping()
            if answer.error is not None:
                yield stream.error(answer.error)
            else:
                if answer.diverged:
                    self.gateway.counts["stream_diverged"] += 1
                yield stream.end(answer.message, answer.info, answer.sent)
            answer.deliver()
        finally:
            if not answer.delivered:
                self.gateway.counts["disconnects"] += 1


def _error(body: dict[str, Any], status: int) -> Response:
    """An error in an API's format. A 4xx says `x-should-retry: false`: the official SDKs (and the CLIs on them)
    would otherwise retry a 409 or a 401 that asking again cannot change (Claude Code for minutes)."""
    headers = {"x-should-retry": "false"} if 400 <= status < 500 else None
    return JSONResponse(body, status_code=status, headers=headers)


def _bad_key() -> RequestError:
    return RequestError(
        "invalid API key: give this session's key (or the gateway's) as x-api-key or Authorization: Bearer",
        status=401,
        code="invalid_api_key",
    )
