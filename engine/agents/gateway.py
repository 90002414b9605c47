"""The session gateway: agent programs call a model API at their session's base URL, and each request is a
turn of the engine (engine/agents/session.py).

    gateway = Gateway(scheduler)
    async with gateway.serving("127.0.0.1", 8100):
        session = gateway.open_session()
        base_url = gateway.base_url(session)         # .../sessions/<id>/v1: give it to the agent, with session.key
        ...                                          # the agent runs, calling POST {base_url}/chat/completions
        chains = await gateway.finish(session.id)    # its trajectories, ended: one sample each

Served, streaming and not: OpenAI Chat Completions (`/sessions/<id>/v1/chat/completions`) and Responses
(`/sessions/<id>/v1/responses`), base URL `.../sessions/<id>/v1`; Anthropic Messages
(`/sessions/<id>/v1/messages`, base URL `.../sessions/<id>`). Starlette under uvicorn, in the caller's event
loop; the host process keeps its signal handlers. Every request is untrusted: it presents its session's key (or
the gateway's own), its body is bounded and read off the loop where large (engine/agents/wire.py), and whatever
it raises is its own (a 4xx in the API's format) or its chain's, never the gateway's.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Literal

import anyio
import uvicorn
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from engine.agents import openai_chat
from engine.agents.answer import Answer
from engine.agents.history import Fit, key, unanswerable
from engine.agents.limits import GatewayLimits
from engine.agents.metrics import GatewayCollector
from engine.agents.request import RequestError, TurnInfo
from engine.agents.routes import GatewayHttp
from engine.agents.session import Asked, Chain, Session, SessionEnv
from engine.agents.streaming import StreamSplitter
from engine.envs.base import EnvRunner
from engine.families import NAMES
from engine.gc_freeze import freeze_long_lived
from engine.multimodal import BoundedCache
from engine.parsers import MalformedCall, ParsedTurn
from engine.scheduler.scheduler import Scheduler
from engine.trajectory import Status, StopReason, Trajectory

log = logging.getLogger(__name__)

# An idle connection is kept this long: longer than clients keep theirs (httpx's pool, the SDKs': 5 s), so the
# client closes first; a server that closes first races a client reusing the connection (a ReadError mid-turn).
KEEP_ALIVE_S = 75.0
SHUTDOWN_S = 10.0  # at the end of serving, how long requests still open are given before they are cancelled
DECODED_IMAGES = 100_000  # digests of images that decoded, kept so that a conversation's are decoded once


class _Server(uvicorn.Server):
    """uvicorn inside a process that owns its signals (the rollout service, a test): none captured here."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Gateway:
    """Sessions over one scheduler. `client_sampling`: what a client's temperature, top_p, seed and the like
    get, "ignore" (counted in `counts["sampling_ignored:<field>"]`) or "refuse" (a 400 naming the field).
    `idle_timeout_s`: an agent silent that long after a reply ends its chain (env_timeout, FAILED). A chain
    waiting for its agent holds no slot of the scheduler. `limits`: what one request may send. `key`: the
    gateway's own key (a fresh one unless given), which reaches every session and opens new ones; each session
    has a key of its own for its agent. `open_on_first_use`: a request to a session id never opened opens it
    (with the gateway's key). `on_finished(session, chains)`: called once per session finished. `gc_freeze`: as
    the engine's setting of that name, once per process when serving starts (a full collection over the SDKs,
    torch and the tokenizer stalled the loop 0.3-0.4 s at a time with 1,000 sessions: benchmarks.agents.gateway)."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        model_name: str = "turnstile",
        client_sampling: Literal["ignore", "refuse"] = "ignore",
        idle_timeout_s: float = 1800.0,
        limits: GatewayLimits | None = None,
        key: str | None = None,
        open_on_first_use: bool = False,
        on_finished: Callable[[Session, list[Trajectory]], None] | None = None,
        gc_freeze: bool = True,
    ):
        reader = getattr(scheduler, "reader", None)
        if reader is not None:  # replies are read as they stream, by the engine's parsers: never another's
            raise ValueError(
                f"the session gateway reads replies with the engine's own parsers, and this run's turns are read by "
                f"SGLang's {reader.name!r} (turn_parser): give a model_family the engine has, with turn_parser auto"
            )
        self.scheduler, self.model_name, self.client_sampling = scheduler, model_name, client_sampling
        self.idle_timeout_s = idle_timeout_s  # longest an agent may take between a reply and its next request
        self.limits = limits or GatewayLimits()
        self.key = key or f"sk-turnstile-{secrets.token_urlsafe(24)}"
        self.open_on_first_use = open_on_first_use
        self.on_finished = on_finished  # told of each session finished, with its chains (once ended)
        self.gc_freeze = gc_freeze  # as the engine's setting: freeze what is alive when serving starts
        self.sessions: dict[str, Session] = {}
        self.counts: Counter[str] = Counter()
        self.url: str | None = None
        self._public_url: str | None = None
        self._tasks: anyio.abc.TaskGroup | None = None
        self._unanswered: set[Answer] = set()  # requests waiting for their turn (failed when serving ends)
        self.decoded_images = BoundedCache[str, bool](DECODED_IMAGES, size=lambda _: 1)  # digests: wire.read
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = GatewayCollector(self)
        self.registry.register(self.collector)
        self.app = Starlette(routes=GatewayHttp(self).routes())

    # -- sessions ----------------------------------------------------------------------------------------
    def open_session(
        self, session_id: str | None = None, metadata: dict[str, Any] | None = None, *, main: Trajectory | None = None
    ) -> Session:
        """A new session (its id a fresh one unless given), its agent's key `session.key`; requests to an id
        never opened are refused. With `main`, the session's first chain is that trajectory, driven by its caller
        (an agent env's, whose env gives it its prompt: engine/agents/env.py) rather than by the gateway;
        `session.main_started` is set when the first request has made it."""
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

    async def finish_session(self, session: Session, *, abort: bool = False) -> list[Trajectory]:
        """`finish` for a session (finished already or not: the same trajectories). The chains the gateway drives
        are waited for; with `abort`, one not waiting for its agent (generating, or waiting to) is ended at once
        (ABORTED: its agent is gone), while one waiting for its agent ends as the session does. A `main` chain is
        its caller's."""
        first = not session.closed
        self.sessions.pop(session.id, None)
        session.closed = True
        for chain in session.chains:
            busy = not chain.waiting
            await chain.end()
            if abort and busy and chain.drive_scope is not None:
                chain.drive_scope.cancel()
        for chain in session.chains:
            if chain.drive_ended is not None:
                await chain.drive_ended.wait()
        chains = [chain.trajectory for chain in session.chains]
        if first and self.on_finished is not None:
            try:
                self.on_finished(session, chains)
            except Exception as exc:  # noqa: BLE001 -- the caller's hook: logged, the session is finished all the same
                log.error("on_finished for session %s raised", session.id, exc_info=exc)
        return chains

    def idle_sessions(self, before: float) -> list[Session]:
        """Open sessions asked nothing since `before` (time.monotonic()) and with no chain generating."""
        return [
            session
            for session in self.sessions.values()
            if session.last_request_at < before and all(chain.waiting or chain.ended for chain in session.chains)
        ]

    # -- serving -----------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def serving(
        self, host: str = "127.0.0.1", port: int = 0, *, public_url: str | None = None
    ) -> AsyncIterator[Gateway]:
        """Serve on host:port (0: a free port) until the block ends; `public_url` is how agents reach it
        (default http://host:port). Sessions still open at the end are finished."""
        if self.gc_freeze:
            freeze_long_lived()
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY on the connections it accepts from a socket of that protocol
        # only. Without it Nagle's algorithm held each reply's body (and each streamed event) until the client's
        # delayed ACK, about 40 ms on a connection kept alive (benchmarks.agents.gateway_live)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(4096)  # connections wait in the backlog until uvicorn accepts them: no start-up race
        bound = sock.getsockname()[1]
        self.url = f"http://{host}:{bound}" if ":" not in host else f"http://[{host}]:{bound}"
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
                        for session in list(self.sessions.values()):
                            await self.finish_session(session, abort=True)
                        for answer in list(self._unanswered):  # a request still waiting: told, its stream ended
                            answer.fail(RequestError("the gateway is shutting down", status=503, kind="server_error"))
                        server.should_exit = True
        finally:
            self._tasks = None
            sock.close()

    async def _drive(self, chain: Chain) -> None:
        assert chain.drive_ended is not None
        try:
            with anyio.CancelScope() as chain.drive_scope:
                env = EnvRunner(SessionEnv(chain), step_timeout=self.idle_timeout_s, name="agent_session")
                # a fork of an agent env's session is kept beside its sample, not scored as one
                await self.scheduler.drive(chain.trajectory, lambda: env, score=chain.session.main is None)
        except Exception as exc:  # noqa: BLE001 -- drive ends its trajectory whatever happens; a bug is logged here
            log.error("the drive of session %s's chain failed", chain.session.id, exc_info=exc)
        finally:
            chain.drive_ended.set()
            chain.turn_ended()  # a request still waiting learns that the chain ended

    # -- one turn --------------------------------------------------------------------------------------------
    def ask(self, session: Session, asked: Asked, *, live: bool) -> Answer:
        """Route the request to its chain (or fork a new one) and claim it, before any await: the answer comes in
        its own task, so a client that leaves mid-way leaves the turn whole (its retry gets it)."""
        if session.closed:
            raise RequestError(f"session {session.id} is finished", status=409)
        if self._tasks is None:
            raise RequestError("the gateway is shutting down", status=503, kind="server_error")
        if asked.tools and (encoder := self.scheduler.encoder).parser is None:  # a tool set's encoder shares its probe
            raise RequestError(
                f"tools are offered, and this model's tool calls cannot be read: {encoder.parser_problem}; start the "
                f"gateway with --model-family naming its family (one of {', '.join(NAMES)})",
                param="tools",
            )
        if (call := unanswerable(asked.messages)) is not None:
            raise RequestError(
                f"a tool result answers tool call {call!r}, which no assistant turn before it made", param="messages"
            )
        chain, fit = session.route(asked)
        if chain is not None and fit.repeat:  # a client's retry of a request in flight or answered: one reply
            self.counts["repeats"] += 1
            answer = Answer(original=chain.last_answer)
            self._start(self._repeat, chain, asked, answer)
            return answer
        if chain is None:
            cause = fit.cause if session.chains else None
            if cause is not None:
                self.counts[f"forks:{cause}"] += 1
            chain = session.start(asked, cause)
            if chain.trajectory is not session.main:  # the gateway drives it (finish waits for it from now on)
                chain.drive_ended = anyio.Event()
        answer = chain.last_answer = Answer()
        chain.claim(asked.keys)
        self._start(self._answer, chain, fit, asked, answer, live)
        return answer

    def _start(self, answering: Any, *args: Any) -> None:
        """Answer a request in a task of the gateway's (`answering(..., answer, ...)`), remembered until done."""
        answer = next(arg for arg in args if isinstance(arg, Answer))
        self._unanswered.add(answer)

        async def run() -> None:
            try:
                await answering(*args)
            finally:
                self._unanswered.discard(answer)

        assert self._tasks is not None
        self._tasks.start_soon(run)

    async def _answer(self, chain: Chain, fit: Fit, asked: Asked, answer: Answer, live: bool) -> None:
        trajectory = chain.trajectory
        try:
            if live:
                split = StreamSplitter(self.encoder_for(asked), stop=asked.stop)
                answer.split = split
                trajectory.token_listener = lambda ids: answer.put(split.feed(ids))
            answer.prompt_tokens = len(trajectory.tokens)
            trajectory.turn_cap, trajectory.turn_stop = asked.cap, asked.stop
            if fit.new is None and chain.drive_ended is not None:  # a new chain: its first turn
                assert self._tasks is not None
                self._tasks.start_soon(self._drive, chain)
            elif fit.new is None:  # the session's main chain: its caller's env takes the prompt from here
                chain.session.main_started.set()
            else:
                await chain.send(asked.messages[-fit.new :], asked.keys[-fit.new :])
            turn = await chain.next_turn()
            answer.finish(*self._reply(chain, asked, turn))
        except RequestError as error:
            answer.fail(error)
        except Exception as exc:  # noqa: BLE001 -- making this reply failed: the request's 500, nothing else's
            log.error("answering a request of session %s failed", chain.session.id, exc_info=exc)
            self.counts["internal_errors"] += 1
            answer.fail(RequestError(f"the gateway failed: {exc!r}", status=500, kind="server_error"))
        finally:
            trajectory.token_listener = None
            chain.release()

    async def _repeat(self, chain: Chain, asked: Asked, answer: Answer) -> None:
        await chain.answered.wait()
        if chain.last_reply is None or chain.last_keys != asked.keys:
            answer.fail(self._no_turn(chain.trajectory))
        else:
            answer.finish(*chain.last_reply)

    def encoder_for(self, asked: Asked) -> Any:
        return self.scheduler.encoder.for_tools(asked.tools, key=asked.tools_key)

    def _reply(self, chain: Chain, asked: Asked, turn: Any) -> tuple[dict[str, Any], TurnInfo]:
        """The reply for the model's turn (kept for a retry of the same request), or the reason there is none."""
        trajectory = chain.trajectory
        if turn is None:
            raise self._no_turn(trajectory)
        encoder = self.encoder_for(asked)
        generated = trajectory.generated_ids(turn).tolist()
        try:
            parsed = encoder.parse_turn(generated, tools=asked.tools)
        except MalformedCall:
            self.counts["parse_failures"] += 1
            parsed = ParsedTurn(encoder.response_text(generated))
        content, stopped_at = _cut_at_stop(parsed.content, asked.stop if turn.finish_reason == "stop" else ())
        ids = []
        for call in parsed.tool_calls:
            ids.append(call.id or encoder.call_id(call.name, chain.session.calls))
            chain.session.calls += 1
        message = openai_chat.message_of(ParsedTurn(content, parsed.reasoning, parsed.tool_calls), ids)
        cut = turn.finish_reason == "length" or trajectory.stop_reason in (StopReason.LENGTH, StopReason.TOKEN_BUDGET)
        by_client = cut and asked.cap is not None and turn.num_generated >= asked.cap
        if cut and not by_client:  # the rollout's cap: the agent could not ask for more, so it is not told to
            self.counts["turns_cut"] += 1
        info = TurnInfo(
            turn.prompt_tokens, turn.num_generated, turn.cached_tokens, length=by_client, stop_sequence=stopped_at
        )
        chain.replied(message, key(message))
        chain.last_keys, chain.last_reply = asked.keys, (message, info)
        return message, info

    def _no_turn(self, trajectory: Trajectory) -> RequestError:
        """The chain ended without a turn for this request: why, as the API's error (worded as the providers word
        theirs, so that a client's own recovery fires: a context too long is compacted, say)."""
        if trajectory.stop_reason in (StopReason.TOKEN_BUDGET, StopReason.LENGTH):
            limits = self.scheduler.limits
            most = limits.max_context_len or trajectory.prompt_length + limits.max_tokens
            return RequestError(
                f"prompt is too long: {len(trajectory.tokens)} tokens > {most} maximum",
                param="messages",
                code="context_length_exceeded",
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


def _cut_at_stop(content: str, stop: tuple[str, ...]) -> tuple[str, str | None]:
    """The content up to the first of the client's stop strings in it (the server stopped there, the string
    kept), and that string; or the content as it is."""
    found = [(at, s) for s in stop if (at := content.find(s)) >= 0]
    if not found:
        return content, None
    at, s = min(found)
    return content[:at], s
