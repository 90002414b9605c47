"""The session gateway: agent programs call a model API at their session's base URL, and each request is a
turn of the engine (engine/agents/session.py).

    gateway = Gateway(scheduler)
    async with gateway.serving("0.0.0.0", 8100, public_url="http://10.0.0.5:8100"):
        session = gateway.open_session()
        base_url = gateway.base_url(session)         # .../sessions/<id>/v1: give it to the agent
        ...                                          # the agent runs, calling POST {base_url}/chat/completions
        chains = await gateway.finish(session.id)    # its trajectories, ended: one sample each

Served, streaming and not: OpenAI Chat Completions (`/sessions/<id>/v1/chat/completions`) and Responses
(`/sessions/<id>/v1/responses`), base URL `.../sessions/<id>/v1`; Anthropic Messages
(`/sessions/<id>/v1/messages`, base URL `.../sessions/<id>`). Starlette under uvicorn, in the caller's event
loop; the host process keeps its signal handlers.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import uvicorn
from openai.types.completion_usage import CompletionUsage, PromptTokensDetails
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.agents import anthropic_messages, openai_chat, openai_responses
from engine.agents.history import same, unanswerable
from engine.agents.request import RequestError
from engine.agents.session import Chain, Session, SessionEnv
from engine.encoding import images_of
from engine.envs.base import EnvRunner
from engine.gc_freeze import freeze_long_lived
from engine.parsers import MalformedCall, ParsedTurn
from engine.scheduler.scheduler import Scheduler
from engine.trajectory import Status, StopReason, Trajectory

log = logging.getLogger(__name__)

# An idle connection is kept this long: longer than clients keep theirs (httpx's pool, the SDKs': 5 s), so the
# client closes first; a server that closes first races a client reusing the connection (a ReadError mid-turn).
KEEP_ALIVE_S = 75.0
SHUTDOWN_S = 10.0  # at the end of serving, how long requests still open are given before they are cancelled


class _Server(uvicorn.Server):
    """uvicorn inside a process that owns its signals (the rollout service, a test): none captured here."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Gateway:
    """Sessions over one scheduler. `client_sampling`: what a client's temperature, top_p, seed and the like
    get, "ignore" (counted in `counts["sampling_ignored:<field>"]`) or "refuse" (a 400 naming the field).
    `idle_timeout_s`: an agent silent that long after a reply ends its chain (env_timeout, FAILED). A chain
    waiting for its agent holds no slot of the scheduler. `gc_freeze`: as the engine's setting of that name, once
    per process when serving starts (a full collection over the SDKs, torch and the tokenizer stalled the loop
    0.3-0.4 s at a time with 1,000 sessions: benchmarks.gateway)."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        model_name: str = "turnstile",
        client_sampling: Literal["ignore", "refuse"] = "ignore",
        idle_timeout_s: float = 1800.0,
        gc_freeze: bool = True,
    ):
        self.scheduler, self.model_name, self.client_sampling = scheduler, model_name, client_sampling
        self.idle_timeout_s = idle_timeout_s  # longest an agent may take between a reply and its next request
        self.gc_freeze = gc_freeze  # as the engine's setting: freeze what is alive when serving starts
        self.sessions: dict[str, Session] = {}
        self.counts: Counter[str] = Counter()
        self.url: str | None = None
        self._public_url: str | None = None
        self._tasks: anyio.abc.TaskGroup | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = GatewayCollector(self)
        self.registry.register(self.collector)
        self.app = Starlette(
            routes=[
                Route("/sessions/{session_id}/v1/chat/completions", self._chat_completions, methods=["POST"]),
                Route("/sessions/{session_id}/v1/responses", self._responses, methods=["POST"]),
                Route("/sessions/{session_id}/v1/messages", self._messages, methods=["POST"]),
                Route("/metrics", self._metrics, methods=["GET"]),
            ]
        )

    # -- sessions ----------------------------------------------------------------------------------------
    def open_session(
        self, session_id: str | None = None, metadata: dict[str, Any] | None = None, *, main: Trajectory | None = None
    ) -> Session:
        """A new session (its id a fresh one unless given); requests to an id never opened are refused. With
        `main`, the session's first chain is that trajectory, driven by its caller (an agent env's, whose env
        gives it its prompt: engine/agents/env.py) rather than by the gateway; `session.main_started` is set
        when the first request has made it."""
        session_id = session_id or uuid.uuid4().hex
        if session_id in self.sessions:
            raise ValueError(f"session {session_id} is open already")
        session = self.sessions[session_id] = Session(session_id, dict(metadata or {}), main=main)
        return session

    def base_url(self, session: Session, api: Literal["openai", "anthropic"] = "openai") -> str:
        """The base URL an agent of this session is given: OpenAI's (`.../v1`), or Anthropic's (without the
        `/v1` its SDK and Claude Code append)."""
        if self._public_url is None:
            raise RuntimeError("the gateway is not serving: use `async with gateway.serving(...)`")
        root = f"{self._public_url}/sessions/{session.id}"
        return root if api == "anthropic" else f"{root}/v1"

    async def finish(self, session_id: str) -> list[Trajectory]:
        """End the session: each chain's pending env step ends it (env done); its trajectories, once ended."""
        return await self.finish_session(self.sessions[session_id])

    async def finish_session(self, session: Session) -> list[Trajectory]:
        """`finish` for a session (finished already or not: the same trajectories). The chains the gateway drives
        are waited for; a `main` chain is its caller's."""
        self.sessions.pop(session.id, None)
        session.closed = True
        for chain in session.chains:
            await chain.end()
        for chain in session.chains:
            if chain.drive_ended is not None:
                await chain.drive_ended.wait()
        return [chain.trajectory for chain in session.chains]

    # -- serving -----------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def serving(
        self, host: str = "127.0.0.1", port: int = 0, *, public_url: str | None = None
    ) -> AsyncIterator[Gateway]:
        """Serve on host:port (0: a free port) until the block ends; `public_url` is how agents reach it
        (default http://host:port). Sessions still open at the end are finished."""
        if self.gc_freeze:
            freeze_long_lived()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(4096)  # connections wait in the backlog until uvicorn accepts them: no start-up race
        bound = sock.getsockname()[1]
        self.url = f"http://{host}:{bound}"
        self._public_url = (public_url or self.url).rstrip("/")
        server = _Server(
            uvicorn.Config(
                self.app, log_level="warning", lifespan="off", access_log=False, timeout_keep_alive=KEEP_ALIVE_S,
                timeout_graceful_shutdown=SHUTDOWN_S,
            )
        )  # fmt: skip

        async def serve() -> None:
            # only `should_exit` ends it, cancelled or not: uvicorn then closes its listener with the event loop's
            # knowledge (closed behind it, the socket's number, reused, breaks the loop's next connect)
            with anyio.CancelScope(shield=True):
                await server.serve([sock])

        try:
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                tasks.start_soon(serve)
                try:
                    yield self
                finally:
                    with anyio.CancelScope(shield=True):
                        for session_id in list(self.sessions):
                            await self.finish(session_id)
                        server.should_exit = True
        finally:
            self._tasks = None
            sock.close()

    async def _drive(self, chain: Chain, done: anyio.Event) -> None:
        try:
            env = EnvRunner(SessionEnv(chain), step_timeout=self.idle_timeout_s, name="agent_session")
            # a fork of an agent env's session is kept beside its sample, not scored as one
            await self.scheduler.drive(chain.trajectory, lambda: env, score=chain.session.main is None)
        finally:
            done.set()
            chain.turn_ended()  # a request still waiting learns that the chain ended

    # -- the dialects ---------------------------------------------------------------------------------------
    async def _metrics(self, request: Request) -> Response:
        """The gateway's own series (sessions, requests, forks, bad requests, ignored sampling fields) in
        Prometheus' text format; the turns' series are the engine's (its observers, its exporter)."""
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    def _session(self, request: Request) -> Session:
        self.counts[f"requests:{request.url.path.rsplit('/v1/', 1)[-1]}"] += 1
        session = self.sessions.get(request.path_params["session_id"])
        if session is None:
            raise RequestError(
                f"no open session {request.path_params['session_id']!r}", status=404, kind="not_found_error"
            )
        return session

    def _count_sampling(self, asked: list[str]) -> None:
        for name in asked:
            self.counts[f"sampling_ignored:{name}"] += 1

    async def _serve(self, request: Request, api: Any) -> tuple[Any, dict[str, Any], TurnInfo] | Response:
        """One request of an API (a module with `read_request` and `error_body`): the request read, the model's
        turn for it; or the error response, counted, when either fails."""
        try:
            session = self._session(request)
            body = api.read_request(await request.body(), client_sampling=self.client_sampling)
            self._count_sampling(body.sampling_asked())
            message, info = await self._turn(session, body.chat_messages(), body.chat_tools(), body.turn_cap)
        except RequestError as error:
            self.counts[f"bad_requests:{error.status}"] += 1
            return JSONResponse(api.error_body(error), status_code=error.status)
        except ClientDisconnect:  # gone before its body arrived: nothing to answer, nothing started
            self.counts["disconnects"] += 1
            return Response(status_code=499)
        return body, message, info

    async def _chat_completions(self, request: Request) -> Response:
        """OpenAI Chat Completions."""
        served = await self._serve(request, openai_chat)
        if isinstance(served, Response):
            return served
        chat, message, info = served
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        reason = openai_chat.finish_reason(message, info.length)
        total = info.prompt_tokens + info.completion_tokens
        usage = CompletionUsage(
            prompt_tokens=info.prompt_tokens, completion_tokens=info.completion_tokens, total_tokens=total,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=info.cached_tokens),
        )  # fmt: skip
        model = chat.model or self.model_name
        if not chat.stream:
            reply = openai_chat.completion(completion_id, model, message, reason, usage)
            return _json(reply)
        include_usage = bool((chat.stream_options or {}).get("include_usage"))
        chunks = openai_chat.chunks(completion_id, model, message, reason, usage if include_usage else None)
        lines = (f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n" for chunk in chunks)
        return _event_stream([*lines, "data: [DONE]\n\n"])

    async def _responses(self, request: Request) -> Response:
        """OpenAI Responses."""
        served = await self._serve(request, openai_responses)
        if isinstance(served, Response):
            return served
        body, message, info = served
        model = body.model or self.model_name
        if not body.stream:
            reply = openai_responses.reply(model, message, info.length, *info.tokens)
            return _json(reply)
        events = openai_responses.events(model, message, info.length, *info.tokens)
        return _event_stream([_event(e) for e in events])

    async def _messages(self, request: Request) -> Response:
        """Anthropic Messages."""
        served = await self._serve(request, anthropic_messages)
        if isinstance(served, Response):
            return served
        body, message, info = served
        reason = anthropic_messages.stop_reason(message, info.length)
        model = body.model or self.model_name
        if not body.stream:
            reply = anthropic_messages.reply(model, message, reason, *info.tokens)
            return _json(reply)
        events = anthropic_messages.events(model, message, reason, *info.tokens)
        return _event_stream([_event(e) for e in events])

    # -- one turn --------------------------------------------------------------------------------------------
    async def _turn(
        self,
        session: Session,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        cap: int | None = None,
    ) -> tuple[dict[str, Any], TurnInfo]:
        """Route the request to its chain (or fork a new one), wait for the model's turn (at most `cap` tokens,
        and the rollout's own cap), and make the reply."""
        if session.closed:
            raise RequestError(f"session {session.id} is finished", status=409)
        if self.scheduler.encoder.processor is None and images_of(messages):
            raise RequestError(
                "the request holds images, but the policy takes none (no VLM processor)", param="messages"
            )
        if (call := unanswerable(messages)) is not None:
            raise RequestError(
                f"a tool result answers tool call {call!r}, which no assistant turn before it made", param="messages"
            )
        chain, fit = session.route(messages, tools)
        if chain is not None and fit.repeat:  # a client's retry of a request in flight or answered: one reply
            self.counts["repeats"] += 1
            await chain.answered.wait()
            if chain.last_reply is None or not same(chain.last_request or [], messages):
                raise self._no_turn(chain.trajectory)
            return chain.last_reply
        if chain is None:
            if self._tasks is None:
                raise RequestError("the gateway is shutting down", status=503, kind="server_error")
            cause = fit.cause if session.chains else None
            if cause is not None:
                self.counts[f"forks:{cause}"] += 1
            chain = session.start(messages, tools, cause)
            if chain.trajectory is not session.main:  # the gateway drives it (finish waits for it from now on)
                chain.drive_ended = anyio.Event()
        chain.pending, chain.answered = messages, anyio.Event()
        chain.trajectory.turn_cap = cap
        try:
            async with chain.lock:
                if fit.new is None and chain.drive_ended is not None:  # a new chain: its first turn
                    self._tasks.start_soon(self._drive, chain, chain.drive_ended)
                elif fit.new is None:  # the session's main chain: its caller's env takes the prompt from here
                    session.main_started.set()
                else:
                    await chain.send(fit.new)
                turn = await chain.next_turn()
            return self._reply(session, chain, messages, tools, turn)
        finally:
            chain.pending = None
            chain.answered.set()

    def _reply(
        self, session: Session, chain: Chain, messages: list[dict[str, Any]], tools: Any, turn: Any
    ) -> tuple[dict[str, Any], TurnInfo]:
        """The reply for the model's turn (kept for a retry of the same request), or the reason there is none."""
        trajectory = chain.trajectory
        if turn is None:
            raise self._no_turn(trajectory)
        encoder = self.scheduler.encoder.for_tools(tools)
        generated = trajectory.generated_ids(turn).tolist()
        try:
            parsed = encoder.parse_turn(generated, tools=tools)
        except MalformedCall:
            self.counts["parse_failures"] += 1
            parsed = ParsedTurn(encoder.response_text(generated))
        ids = []
        for call in parsed.tool_calls:
            family = encoder.family
            ids.append(call.id or (family.call_id(call.name, session.calls) if family else f"call{session.calls:05d}"))
            session.calls += 1
        message = openai_chat.message_of(parsed, ids)
        chain.replied(message)
        length = turn.finish_reason == "length" or trajectory.stop_reason in (
            StopReason.LENGTH,
            StopReason.TOKEN_BUDGET,
        )
        chain.last_request = messages
        chain.last_reply = message, TurnInfo(length, turn.prompt_tokens, turn.num_generated, turn.cached_tokens)
        return chain.last_reply

    @staticmethod
    def _no_turn(trajectory: Trajectory) -> RequestError:
        """The chain ended without a turn for this request: why, as the API's error."""
        if trajectory.stop_reason in (StopReason.TOKEN_BUDGET, StopReason.LENGTH):
            return RequestError(
                "the conversation does not fit the session's token budget or context window",
                param="messages",
                kind="invalid_request_error",
            )
        if trajectory.stop_reason == StopReason.STALE:
            return RequestError(
                "the session's chain ended stale: its tokens span more weight versions than max_staleness allows "
                "(a chain is never regenerated under its agent); start the conversation again",
                status=409,
            )
        last = trajectory.errors[-1].message if trajectory.errors else str(trajectory.stop_reason)
        status = 502 if trajectory.status == Status.FAILED else 409
        return RequestError(
            f"the session's trajectory ended ({trajectory.stop_reason}): {last}", status=status, kind="server_error"
        )


@dataclass(frozen=True, slots=True)
class TurnInfo:
    length: bool  # the turn was cut by the token cap, the budget or the context window
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, those the server found in its prefix cache

    @property
    def tokens(self) -> tuple[int, int, int]:
        """(prompt, completion, cached): the usage every API reports."""
        return self.prompt_tokens, self.completion_tokens, self.cached_tokens


def _json(reply: Any) -> Response:
    """A reply of the SDK's types, serialized by pydantic-core (as the SDKs send it: fields set, none added)."""
    return Response(reply.model_dump_json(exclude_unset=True), media_type="application/json")


def _event(event: Any) -> str:
    """A typed stream event as a server-sent event, named by its type (Responses', Anthropic's)."""
    return f"event: {event.type}\ndata: {event.model_dump_json(exclude_unset=True)}\n\n"


def _event_stream(lines: list[str]) -> StreamingResponse:
    """Server-sent events: the turn is whole before its first event is sent."""

    async def send() -> AsyncIterator[str]:
        for line in lines:
            yield line

    return StreamingResponse(send(), media_type="text/event-stream")


class GatewayCollector(Collector):
    """The gateway's counts as `turnstile_agent_*` series at scrape time (labels: the API, the fork cause, the
    HTTP status, the ignored field: bounded sets, never a session id)."""

    SERIES = {  # count key -> (series, help, label)
        "requests": ("agent_requests", "Agent requests to the gateway, by API.", "api"),
        "forks": ("agent_forks", "Chains started by a request that continued none, by cause.", "cause"),
        "bad_requests": ("agent_bad_requests", "Requests answered with an error, by HTTP status.", "status"),
        "sampling_ignored": (
            "agent_sampling_ignored", "Client sampling fields ignored for the rollout's settings, by field.", "field",
        ),
        "parse_failures": ("agent_parse_failures", "Turns whose tool calls the family's parser could not read.", ""),
        "repeats": ("agent_repeated_requests", "Requests repeating one in flight or answered (a client's retry).", ""),
        "disconnects": ("agent_disconnects", "Requests whose client left before its body arrived.", ""),
        "agent_exits": ("agent_exits", "Agent programs of agent envs ended, by outcome.", "outcome"),
    }  # fmt: skip

    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        counts = dict(self.gateway.counts)  # a copy: the scrape may run while requests count
        for key, (series, doc, label) in self.SERIES.items():
            family = CounterMetricFamily(f"turnstile_{series}", doc, labels=[label] if label else [])
            for name, value in counts.items():
                head, _, value_label = name.partition(":")
                if head == key:
                    family.add_metric([value_label] if label else [], value)
            yield family
        sessions = list(self.gateway.sessions.values())
        chains = [chain for session in sessions for chain in session.chains if not chain.ended]
        yield GaugeMetricFamily("turnstile_agent_sessions", "Open sessions.", value=len(sessions))
        waiting = GaugeMetricFamily(
            "turnstile_agent_chains", "Chains not ended, by what they wait for.", labels=["waiting_for"]
        )
        waiting.add_metric(["agent"], sum(chain.waiting for chain in chains))
        waiting.add_metric(["model"], sum(not chain.waiting for chain in chains))
        yield waiting
