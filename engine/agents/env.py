"""Agent envs: an env, loaded by `rollout_interaction_env_path` like any other, that runs an agent program for a
sample against its own session of the gateway.

    from engine.agents.env import AgentEnv, AgentRun

    class MyAgent(AgentEnv):
        timeout_s = 600.0                                     # the agent's deadline

        async def run(self, agent: AgentRun) -> dict:
            result = await agent.run_process(["my-agent", "--task", agent.task])  # OPENAI_BASE_URL etc. set
            return {"reward": 1.0 if "PASS" in result.stdout else 0.0}             # the env's info

    def build_env(sample=None, args=None, **kw): return MyAgent()

The engine gives the env's trajectory (a member of its group, as for any env) to the agent's session as its
main chain: the agent's first request is its prompt (its messages and tools: `gives_prompt`), each request a
turn, the time until the next request the turn's env phase; the agent's exit ends it (env done), with what
`run` returned as the step's info (`info["reward"]` is its reward; slime's reward path runs as for any env).
A request that continues no chain of the session forks one (engine/agents/session.py): `trajectory.forks`.

Timeouts, one chain: the agent's deadline (`timeout_s`: `run` is cancelled, its processes killed) comes
before the env's step timeout (`timeout_s` + `CLOSE_GRACE_S`), so the agent's deadline is the one that
fires. An agent that crashes (`run` raises, or a process it ran exits non-zero), hangs past its deadline or
exits before its first request is an AGENT error: its trajectory ends FAILED, retried with a fresh agent only
before its first request (`retry.per_turn.agent`), nothing else affected, and every process `run_process`
started is gone afterwards (engine/agents/process.py). The env's close then runs `AgentEnv.aclose` (bounded by
`close_timeout_s`) and ends the session: its forks still generating are ended at once (ABORTED), not waited for.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from engine.agents.process import ProcessResult, run_process
from engine.agents.session import Session, SessionEnv
from engine.envs.base import EnvRunner
from engine.errors import EnvError, ErrorClass
from engine.trajectory import Trajectory

if TYPE_CHECKING:
    from engine.hosting import EnvHost

log = logging.getLogger(__name__)

CLOSE_GRACE_S = 30.0  # past the agent's deadline, the time its end (killing, reaping) may take
FORKS_END_S = 5.0  # past the env's own close (`AgentEnv.aclose`), the time its session's forks may take to end


class AgentFailed(Exception):
    """What an agent's `run` raises to say the agent failed (a crash); any other exception says the same."""


class AgentEnv:
    """An agent program for one sample: `run` starts it with its session's addresses and returns its info."""

    timeout_s: float = 1800.0  # the agent's deadline, from its start
    close_timeout_s: float = 10.0  # the bound on `aclose`

    async def run(self, agent: AgentRun) -> Mapping[str, Any] | None:
        raise NotImplementedError

    def reset(self) -> Any:
        raise RuntimeError(
            f"{type(self).__name__} is an agent env: the engine runs its agent, whose requests are its steps; it "
            "runs in the engine's process (env_workers 0)"
        )

    async def astep(self, response_text: str) -> Any:
        return self.reset()

    async def aclose(self) -> None:
        """End what the agent left that `run_process` does not (a container, a remote sandbox)."""

    def bind_runner(self, host: EnvHost, trajectory: Trajectory, sample: Any, name: str) -> EnvRunner:
        """The engine's hook (engine/hosting.py): `trajectory` is the main chain of a session of its gateway."""
        return AgentHost.of(host).runner(self, trajectory, sample, name)


@dataclass
class AgentRun:
    """What an agent is given: its session's base URLs and key, the sample's task, its deadline."""

    session_id: str
    base_url: str  # OpenAI's: .../sessions/<id>/v1
    anthropic_base_url: str  # Anthropic's: .../sessions/<id>
    model: str
    sample: Any  # the env's sample (an EnvSample, or slime's Sample)
    deadline: float  # time.monotonic() by which the agent ends
    api_key: str  # its session's key: the gateway serves the session only to a request that presents it

    @property
    def task(self) -> Any:
        """The prompt row's prompt: the task to give the agent (a string, or messages)."""
        return getattr(self.sample, "prompt", None)

    def environ(self) -> dict[str, str]:
        """The variables the OpenAI and Anthropic SDKs (and the CLIs on them) read for their endpoint."""
        return {
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_KEY": self.api_key,
            "ANTHROPIC_BASE_URL": self.anthropic_base_url,
            "ANTHROPIC_API_KEY": self.api_key,
            "TURNSTILE_MODEL": self.model,
        }

    async def run_process(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        check: bool = True,
    ) -> ProcessResult:
        """Run a program with `environ()` added to `env` (default: this process's environment); it and every
        process it starts are gone when this returns or is cancelled. A non-zero exit raises AgentFailed with
        the end of its stderr, unless `check` is False."""
        base = dict(os.environ if env is None else env)
        result = await run_process(argv, marker=self.session_id, env={**base, **self.environ()}, cwd=cwd, stdin=stdin)
        if check and result.returncode != 0:
            raise AgentFailed(f"{argv[0]} exited with status {result.returncode}: {result.said()}")
        return result


@dataclass
class _Outcome:
    """How an agent ended: `finished` (info set), `crashed`, `hung`, `no_request`, `stopped`."""

    kind: str
    info: dict[str, Any] = field(default_factory=dict)
    message: str = ""


class AgentHost:
    """The gateway agent envs run their agents against, served in the engine's task group from the first agent
    env built until the engine ends (settings: agent_host, agent_port, agent_public_url)."""

    def __init__(self, scheduler: Any, *, host: str, port: int, public_url: str | None, client_sampling: str):
        from engine.agents.gateway import Gateway

        self.gateway = Gateway(scheduler, client_sampling=client_sampling, gc_freeze=False)  # type: ignore[arg-type]
        self.host, self.port, self.public_url = host, port, public_url
        self._tasks: anyio.abc.TaskGroup | None = None
        self._serving: anyio.Event | None = None
        self._start_error: BaseException | None = None

    @classmethod
    def of(cls, host: EnvHost) -> AgentHost:
        """The engine's agent host, made by its first agent env: served in its task group, on its scheduler, with
        its agent settings, the gateway's series on its /metrics."""
        return host.shared(cls, cls._on)

    @classmethod
    def _on(cls, host: EnvHost) -> AgentHost:
        config = host.config
        agents = cls(
            host.scheduler, host=config.agent_host, port=config.agent_port, public_url=config.agent_public_url,
            client_sampling=config.agent_client_sampling,
        )  # fmt: skip
        agents.attach(host.tasks)
        if host.registry is not None:  # the gateway's series beside the engine's, on the engine's /metrics
            host.registry.register(agents.gateway.collector)
        return agents

    def attach(self, tasks: anyio.abc.TaskGroup) -> None:
        """The task group to serve the gateway and run the agents in (the engine's)."""
        self._tasks = tasks

    def start_soon(self, fn: Any, *args: Any) -> None:
        assert self._tasks is not None, "not attached"
        self._tasks.start_soon(fn, *args)

    async def ready(self) -> AgentHost:
        """The gateway serving (started on the first call)."""
        if self._tasks is None:
            raise RuntimeError("agent envs run inside a running engine (async with RolloutEngine(...))")
        if self._serving is None:
            self._serving = anyio.Event()
            self._tasks.start_soon(self._serve)
        await self._serving.wait()
        if self._start_error is not None:
            raise EnvError(ErrorClass.ENV_EXCEPTION, f"the agent gateway did not start: {self._start_error!r}")
        return self

    async def _serve(self) -> None:
        assert self._serving is not None
        try:
            async with self.gateway.serving(self.host, self.port, public_url=self.public_url):
                log.info("agent gateway serving at %s", self.gateway.url)
                self._serving.set()
                await anyio.sleep_forever()
        except Exception as exc:  # noqa: BLE001 -- every agent env learns it (an address in use, say)
            self._start_error = exc
            log.error("the agent gateway failed", exc_info=exc)
        finally:
            self._serving.set()

    def runner(self, env: AgentEnv, trajectory: Trajectory, sample: Any, name: str) -> EnvRunner:
        """The runner the scheduler drives `trajectory` with, its env the agent's session."""
        return EnvRunner(
            AgentSessionEnv(self, env, trajectory, sample),
            step_timeout=env.timeout_s + CLOSE_GRACE_S,
            name=name,
            close_timeout=env.close_timeout_s + FORKS_END_S,
        )

    def count(self, outcome: str) -> None:
        self.gateway.counts[f"agent_exits:{outcome}"] += 1


class AgentSessionEnv(SessionEnv):
    """The env of an agent env's trajectory, the main chain of its session: reset starts the agent and gives
    its first request as the prompt; a step hands the model's turn over and returns the agent's next messages,
    or ends (done, the agent's info) when the agent has exited."""

    gives_prompt = True

    def __init__(self, host: AgentHost, agent: AgentEnv, trajectory: Trajectory, sample: Any):
        self.host, self.agent, self.trajectory, self.sample = host, agent, trajectory, sample
        self.session: Session | None = None
        self.outcome: _Outcome | None = None
        self._ended: anyio.Event | None = None  # the agent task is over (processes reaped)
        self._cancel: anyio.CancelScope | None = None

    async def areset(self) -> tuple[dict[str, Any], dict[str, Any]]:
        await self._stop()  # an earlier attempt's agent (a retry of the reset)
        gateway = (await self.host.ready()).gateway
        if self.session is not None:
            await gateway.finish_session(self.session)
        metadata = {"agent": type(self.agent).__name__}
        self.session = session = gateway.open_session(metadata=metadata, main=self.trajectory)
        self.outcome, self._ended = None, anyio.Event()
        run = AgentRun(
            session_id=session.id,
            base_url=gateway.base_url(session),
            anthropic_base_url=gateway.base_url(session, "anthropic"),
            model=gateway.model_name,
            sample=self.sample,
            deadline=time.monotonic() + self.agent.timeout_s,
            api_key=session.key,
        )
        self.host.start_soon(self._run_agent, run, session, self._ended)
        await _first_of(session.main_started, self._ended)  # its first request, or its end without one
        if not session.chains:
            raise self._error()
        self.chain = session.chains[0]
        return {"prompt": list(self.chain.history), "tools": self.chain.tools}, {}

    async def astep(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        observation, done, info = await super().astep(response_text)
        if not done:
            return observation, done, info
        assert self._ended is not None
        await self._ended.wait()  # the stream closes when the agent has ended
        if self.outcome is None or self.outcome.kind != "finished":
            raise self._error()
        return {}, True, dict(self.outcome.info)

    async def aclose(self) -> None:
        """The agent ended (its processes gone), then what it left (the env's `aclose`, within its own bound,
        whatever the forks do), then its session: the forks it made end at once, ABORTED if still generating (a
        long turn would hold the close past its bound), and a request still open gets an error."""
        await self._stop()
        try:
            with anyio.move_on_after(self.agent.close_timeout_s, shield=True) as bound:
                await self.agent.aclose()
            if bound.cancelled_caught:
                raise TimeoutError(f"aclose still ran at its bound, close_timeout_s ({self.agent.close_timeout_s:g} s)")
        finally:
            if self.session is not None:
                await self.host.gateway.finish_session(self.session, abort=True)
                if self.session.chains:
                    self.session.chains[0].turn_ended()  # a request still waiting for a turn learns there is none

    def _error(self) -> EnvError:
        outcome = self.outcome or _Outcome("crashed", message="the agent ended without an outcome")
        return EnvError(ErrorClass.AGENT, f"agent {type(self.agent).__name__} {outcome.kind}: {outcome.message}")

    async def _stop(self) -> None:
        if self._cancel is not None:
            self._cancel.cancel()
        if self._ended is not None:
            await self._ended.wait()

    async def _run_agent(self, run: AgentRun, session: Session, ended: anyio.Event) -> None:
        # stopped unless it ends on its own: its trajectory ended first (`_stop`), or the engine did
        outcome = _Outcome("stopped", message="stopped before it ended (its trajectory or the engine ended first)")
        try:
            with anyio.CancelScope() as self._cancel:
                with anyio.move_on_after(self.agent.timeout_s) as deadline:
                    info = await self.agent.run(run)
                if deadline.cancelled_caught:
                    outcome = _Outcome("hung", message=f"still running at its deadline ({self.agent.timeout_s:g} s)")
                elif not session.chains:
                    outcome = _Outcome("no_request", message="exited without a request to its session")
                else:
                    outcome = _Outcome("finished", info=dict(info or {}))
        except Exception as exc:  # noqa: BLE001 -- the agent's failure is its trajectory's alone
            outcome = _Outcome("crashed", message=str(exc) if isinstance(exc, AgentFailed) else repr(exc))
        finally:
            with anyio.CancelScope(shield=True):
                self.outcome = outcome
                self.host.count(outcome.kind)
                if session.chains:
                    await session.chains[0].end()  # the main chain's waiting step ends
                ended.set()


async def _first_of(*events: anyio.Event) -> None:
    """Until one of `events` is set."""

    async def wait(event: anyio.Event, scope: anyio.CancelScope) -> None:
        await event.wait()
        scope.cancel()

    async with anyio.create_task_group() as tasks:
        for event in events:
            tasks.start_soon(wait, event, tasks.cancel_scope)
