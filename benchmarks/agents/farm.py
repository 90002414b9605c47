"""The benchmarks' agents, in a process of their own, as agent programs are: their SDK's CPU is not the rollout
service's.

    python -m benchmarks.agents.farm '<AgentPlan's fields as JSON, and "faults": AgentFaults' fields or null>'

One process runs every agent of a run (one process each would cost a Python start and an `openai` import per
sample on two cores). It reads JSON lines on stdin and writes JSON lines on stdout:

  in:  {"op": "start", "id": N, "seed": S, "base_url": ..., "api_key": ..., "model": ...}
       {"op": "cancel", "id": N}
  out: {"ready": true}                                   once, its imports done
       {"id": N, "reward": R, "counts": {...}}           the agent finished
       {"id": N, "error": "...", "counts": {...}}        it crashed (a request failed, or a crash injected)
       {"id": N, "cancelled": true, "counts": {...}}

An agent (seeded by S) makes 1 to `max_requests` chat completions through the official `openai` SDK (their
number Pareto-tailed), runs a tool between them for a lognormal time, and reports a reward of 0 or 1. With
`AgentFaults` (the fault suite, benchmarks/faults/suite.py), some agents crash or hang partway, and some requests are
preceded by a malformed one (which must be refused with a 4xx) or first sent streaming and dropped after the
first chunk (then sent again). `counts` says what each agent did and had injected.

`AgentFarm` is the rollout service's side: it starts the process; `FarmAgent` is the agent env whose `run`
runs one agent there.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import random
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import anyio
import httpx
import openai
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from engine.agents.env import AgentEnv, AgentRun


@dataclass(frozen=True)
class AgentPlan:
    """What the agents do, drawn per agent from its seed (the agent benchmark's defaults)."""

    max_requests: int = 30
    request_tail: float = 0.9  # Pareto shape of the number of requests: P(n >= k) = k ** -tail, capped
    tool_median_s: float = 0.6  # the tool time between two requests: lognormal, this median, capped
    tool_sigma: float = 1.0
    tool_max_s: float = 10.0


@dataclass(frozen=True)
class AgentFaults:
    """What the fault suite injects into agents, each drawn per agent (crash, hang) or per request."""

    crash: float = 0.0  # share of agents that raise partway (before one of their requests)
    hang: float = 0.0  # share of agents that stop partway and never ask again (until their deadline)
    malformed: float = 0.0  # share of requests preceded by a malformed request of one of MALFORMED's kinds
    disconnect: float = 0.0  # share of requests first sent streaming and dropped after the first chunk


MALFORMED = ("not_json", "n_2", "tool_result_for_no_call", "unknown_session")


class Script:
    """What the agent seeded by `seed` does: its requests, tool times, reward, and the faults drawn for it."""

    def __init__(self, seed: int, plan: AgentPlan, faults: AgentFaults):
        rng = random.Random(seed)
        self.requests = min(plan.max_requests, int(rng.paretovariate(plan.request_tail)))
        median, cap = math.log(plan.tool_median_s), plan.tool_max_s
        self.tool_s = [min(cap, rng.lognormvariate(median, plan.tool_sigma)) for _ in range(self.requests)]
        self.reward = float(rng.random() < 0.5)
        self.crash_at = rng.randrange(self.requests) if rng.random() < faults.crash else None
        self.hang_at = rng.randrange(self.requests) if rng.random() < faults.hang else None
        self.malformed = [rng.choice(MALFORMED) if rng.random() < faults.malformed else None for _ in self.tool_s]
        self.disconnect = [rng.random() < faults.disconnect for _ in self.tool_s]


async def run_agent(script: Script, start: dict[str, Any], http: httpx.AsyncClient, counts: Counter[str]) -> None:
    """One agent: `script.requests` chat completions, a tool run between them, its script's faults on the way."""
    client = openai.AsyncOpenAI(base_url=start["base_url"], api_key=start["api_key"], http_client=http, max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": f"Task {start['id']}: fix the failing test."},
    ]
    for index in range(script.requests):
        if script.crash_at == index:
            counts["crashed"] += 1
            raise RuntimeError(f"injected crash before request {index}")
        if script.hang_at == index:
            counts["hung"] += 1
            await anyio.sleep_forever()
        if (kind := script.malformed[index]) is not None:
            await _malformed(kind, start, messages, http, counts)
        if script.disconnect[index]:  # the reply's stream left after its first chunk; the same request again
            stream = await client.chat.completions.create(model=start["model"], messages=messages, stream=True)
            async for _chunk in stream:
                break
            await stream.close()
            counts["disconnects"] += 1
        reply = await client.chat.completions.create(model=start["model"], messages=messages)
        counts["requests"] += 1
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        if index + 1 == script.requests:
            return
        await anyio.sleep(script.tool_s[index])  # the agent's tool (a test run, a search)
        messages.append({"role": "user", "content": f"Tool output {index}: 3 passed, 1 failed."})


async def _malformed(
    kind: str, start: dict[str, Any], messages: list[dict[str, Any]], http: httpx.AsyncClient, counts: Counter[str]
) -> None:
    """One malformed request of `kind`; it must be refused with a 4xx, else the agent crashes (and says why)."""
    url, body = f"{start['base_url']}/chat/completions", {"model": start["model"], "messages": messages}
    headers = {"Authorization": f"Bearer {start['api_key']}"}
    if kind == "not_json":
        reply = await http.post(url, content=b'{"messages": [', headers={**headers, "content-type": "application/json"})
    elif kind == "n_2":
        reply = await http.post(url, json={**body, "n": 2}, headers=headers)
    elif kind == "tool_result_for_no_call":
        orphan = {"role": "tool", "tool_call_id": "call_none", "content": "42"}
        reply = await http.post(url, json={**body, "messages": [*messages, orphan]}, headers=headers)
    else:
        other = start["base_url"].replace(f"/sessions/{start['session_id']}/", "/sessions/no-such-session/")
        reply = await http.post(f"{other}/chat/completions", json=body, headers=headers)
    counts[f"malformed_sent:{kind}"] += 1
    if not 400 <= reply.status_code < 500:
        raise RuntimeError(f"a malformed request ({kind}) was answered HTTP {reply.status_code}, not a 4xx")
    counts["malformed_refused"] += 1


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def serve(config: dict[str, Any]) -> None:
    """Run agents as stdin asks until it closes."""
    faults = AgentFaults(**config.pop("faults") or {})
    plan = AgentPlan(**config)
    scopes: dict[int, anyio.CancelScope] = {}
    # One pool for every agent: a client each would load a TLS context each (25 ms); a bounded keep-alive pool,
    # since httpcore scans its connections for every request.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, timeout=3600.0, trust_env=False) as http:
        _emit({"ready": True})

        async def one(start: dict[str, Any], scope: anyio.CancelScope) -> None:
            counts: Counter[str] = Counter()
            with scope:  # cancelled by a cancel line, perhaps before it starts
                try:
                    script = Script(start["seed"], plan, faults)
                    await run_agent(script, start, http, counts)
                    _emit({"id": start["id"], "reward": script.reward, "counts": counts})
                except Exception as error:  # the agent crashed: the rollout service's side fails its run
                    _emit({"id": start["id"], "error": f"{type(error).__name__}: {error}", "counts": counts})
            if scope.cancelled_caught:
                _emit({"id": start["id"], "cancelled": True, "counts": counts})
            scopes.pop(start["id"], None)

        async with anyio.create_task_group() as group:
            async for line in anyio.wrap_file(sys.stdin):
                message = json.loads(line)
                if message["op"] == "start":
                    scopes[message["id"]] = anyio.CancelScope()
                    group.start_soon(one, message, scopes[message["id"]])
                elif (scope := scopes.get(message["id"])) is not None:
                    scope.cancel()
            group.cancel_scope.cancel()  # stdin closed: the run is over


class AgentFarm:
    """The farm process, from the rollout service's side: `await farm.run(seed, agent)` runs one agent there
    and returns its info (`{"reward": R}`); cancelling the call cancels the agent. `counts` sums what every
    agent reported (requests made, faults injected), `errors` why agents crashed."""

    def __init__(self, plan: AgentPlan, faults: AgentFaults | None = None):
        self.config = {**asdict(plan), "faults": None if faults is None else asdict(faults)}
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()  # why agents crashed, by message
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[anyio.Event, list[dict[str, Any]]]] = {}
        self._process: Process | None = None
        self._send_lock = anyio.Lock()

    async def __aenter__(self) -> AgentFarm:
        command = [sys.executable, "-m", "benchmarks.agents.farm", json.dumps(self.config, default=str)]
        self._process = await anyio.open_process(command, stderr=None)
        self._lines = BufferedByteReceiveStream(self._process.stdout)  # type: ignore[arg-type]
        with anyio.fail_after(60):  # its imports done: agents start at once from here
            ready = json.loads(await self._lines.receive_until(b"\n", 1 << 20))
        assert ready == {"ready": True}, ready
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        self._group.start_soon(self._read)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._process is not None and self._process.stdin is not None
        await self._process.stdin.aclose()
        with anyio.fail_after(10):
            await self._process.wait()
        await self._group.__aexit__(*exc)

    async def _read(self) -> None:
        assert self._process is not None
        with contextlib.suppress(anyio.EndOfStream, anyio.IncompleteRead):
            while True:
                message = json.loads(await self._lines.receive_until(b"\n", 1 << 20))
                self.counts.update(message.get("counts", {}))
                if "error" in message:
                    self.errors[message["error"]] += 1
                waiting = self._waiting.pop(message["id"], None)
                if waiting is not None:
                    waiting[1].append(message)
                    waiting[0].set()
        for event, result in self._waiting.values():  # the farm is gone: every agent still running failed
            result.append({"error": f"the agent farm exited with {self._process.returncode}"})
            event.set()

    async def _send(self, message: dict[str, Any]) -> None:
        assert self._process is not None and self._process.stdin is not None
        async with self._send_lock:
            await self._process.stdin.send((json.dumps(message) + "\n").encode())

    async def run(self, seed: int, agent: AgentRun) -> dict[str, Any]:
        key = next(self._ids)
        event, result = anyio.Event(), []
        self._waiting[key] = (event, result)
        start = {"op": "start", "id": key, "seed": seed, "model": agent.model, "session_id": agent.session_id,
                 "base_url": agent.base_url, "api_key": agent.api_key}  # fmt: skip
        try:
            await self._send(start)
            await event.wait()
        finally:
            if not event.is_set():
                self._waiting.pop(key, None)
                with anyio.CancelScope(shield=True):
                    await self._send({"op": "cancel", "id": key})
        if "error" in result[0]:
            raise RuntimeError(f"agent {key}: {result[0]['error']}")
        return {"reward": result[0]["reward"]}


class FarmAgent(AgentEnv):
    """A sample's agent, run in the farm; `timeout_s` is its deadline."""

    def __init__(self, seed: int, farm: AgentFarm, timeout_s: float = 600.0):
        self.seed, self.farm, self.timeout_s = seed, farm, timeout_s

    async def run(self, agent: AgentRun) -> dict[str, Any]:
        return await self.farm.run(self.seed, agent)


if __name__ == "__main__":
    anyio.run(serve, json.loads(sys.argv[1]))
