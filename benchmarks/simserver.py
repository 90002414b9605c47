"""A simulated SGLang server: SGLang 0.5's HTTP API, continuous-batching timing, a deterministic "model".

    python -m benchmarks.simserver --port 0 --max-running 128     # prints "listening on http://127.0.0.1:PORT"

Timing. One asyncio task runs the batch loop. A step admits waiting requests (up to `max_running`
running, and `max_prefill_tokens` new tokens), then lasts

    prefill_s_per_token * uncached_new_tokens + decode_a + decode_b * running

(an asyncio.sleep stands in for the GPU; overshoot is paid back in the next step), after which every
running request has one more token. A prefix cache of 16-token blocks (chain hash, LRU) stands in for
SGLang's radix cache: a request extending an earlier one pays prefill for its new part only. A weight
update flushes it, as SGLang's does.

The model (longtail_model.TurnModel) makes every policy see the same work: a turn's length and tokens
depend on the conversation up to the turn's start only, and an aborted turn resumed later continues
the same stream. Text is a placeholder; clients decode `output_ids` themselves.

Endpoints: POST /generate, /abort_request, /pause_generation, /continue_generation,
/update_weights_from_disk; GET /model_info, /health, /health_generate, /server_info (and the deprecated
/get_model_info, /get_server_info, which sglang-router reads when a worker registers); and for
the benchmark GET /stats (measurements since the last POST /stats/reset) and POST /sim/reset (abort
everything, forget the model's and the cache's state, set the weight version).

Fault injection (benchmarks/faults.py), off by default: with `error_rate` a /generate request is answered
at once with HTTP `error_status` (an overloaded or failing server); with `malformed_rate` one is generated
in full (its tokens count as generated) and then answered with HTTP 200 and a body that is not a generate
reply (not JSON, or JSON without meta_info, or log-probs that do not match the tokens). Which requests
fail is drawn from a generator seeded with `fault_seed`, in the order requests arrive. POST /sim/faults
{"error_rate", "malformed_rate", "error_status", "fault_seed"} changes them while the server runs (the
generator is seeded again); GET /sim/faults gives them and how many of each were injected since the last
POST /stats/reset (also in /stats, as `injected`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web

from benchmarks.longtail_model import PrefixCache, Request, Stats, TurnModel

MAX_DEBT_S = 0.005


@dataclass(frozen=True, slots=True)
class SimConfig:
    seed: int = 0
    max_running: int = 128
    max_prefill_tokens: int = 16384
    decode_a: float = 0.003  # seconds per decode step, fixed part
    decode_b: float = 0.00004  # seconds per decode step, per running request
    prefill_s_per_token: float = 0.000005
    median_tokens: float = 80.0
    sigma: float = 0.99  # lognormal: p99/p50 = exp(2.326 * sigma) ~ 10
    max_turn_tokens: int = 1000
    cache_tokens: int = 2_000_000
    flush_on_update: bool = True
    weight_version: str = "v0"
    # fault injection (see the module docstring); off by default
    error_rate: float = 0.0  # share of /generate requests answered at once with HTTP error_status
    error_status: int = 503
    malformed_rate: float = 0.0  # share generated in full, then answered with a body that is no generate reply
    fault_seed: int = 0


FAULT_KEYS = ("error_rate", "malformed_rate", "error_status", "fault_seed")
MALFORMED_BODIES = ("not_json", "no_meta_info", "logprobs_mismatch")


@dataclass(slots=True)
class Faults:
    """What the server injects now, and how many of each it has injected."""

    error_rate: float = 0.0
    malformed_rate: float = 0.0
    error_status: int = 503
    fault_seed: int = 0
    injected_errors: int = 0
    injected_malformed: int = 0
    rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.fault_seed)

    def settings(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in FAULT_KEYS}

    def counts(self) -> dict[str, int]:
        return {"server_error": self.injected_errors, "malformed": self.injected_malformed}


class SimServer:
    def __init__(self, config: SimConfig):
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.paused = False
        self._wake = asyncio.Event()
        self._mark: float | None = None  # while a step runs: the time up to which running_seconds is counted
        self.faults = Faults(**{key: getattr(config, key) for key in FAULT_KEYS})
        self.reset_state(config.weight_version)

    def reset_state(self, weight_version: str) -> None:
        for request in [*self.waiting, *self.running]:
            self._finish(request, {"type": "abort", "message": "server reset"})
        self.waiting.clear()
        self.running.clear()
        cfg = self.config
        self.model = TurnModel(cfg.seed, cfg.median_tokens, cfg.sigma, cfg.max_turn_tokens)
        self.cache = PrefixCache(self.config.cache_tokens)
        self.weight_version = weight_version
        self.paused = False
        self.stats = Stats()

    # -- the batch loop ------------------------------------------------------------------------------
    async def batch_loop(self) -> None:
        deadline: float | None = None  # when the current step should end; None after an idle spell
        while True:
            if self.paused or not (self.waiting or self.running):
                self._wake.clear()
                await self._wake.wait()
                deadline = None
                continue
            start = time.monotonic()
            prefill = self._admit()
            cfg = self.config
            # a step that overshot (timer granularity) is paid back by the next, up to MAX_DEBT_S
            base = start if deadline is None else max(deadline, start - MAX_DEBT_S)
            deadline = base + (cfg.prefill_s_per_token * prefill + cfg.decode_a + cfg.decode_b * len(self.running))
            self._mark = start
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            self._integrate()
            self._mark = None
            self.stats.busy_seconds += time.monotonic() - start
            self.stats.num_steps += 1
            self.stats.generated_tokens += len(self.running)
            still = []
            for request in self.running:
                request.new += 1
                if (reason := request.finish_reason()) is not None:
                    self._finish(request, reason)
                else:
                    still.append(request)
            self.running = still

    def _admit(self) -> int:
        new_tokens = 0
        while self.waiting and len(self.running) < self.config.max_running:
            request = self.waiting[0]
            ids = request.input_ids + request.output()[0]  # a retracted request comes back with its tokens
            uncached = len(ids) - min(self.cache.match(ids), len(ids) - 1)
            if new_tokens and new_tokens + uncached > self.config.max_prefill_tokens:
                break
            self.waiting.popleft()
            self.running.append(request)
            if not request.admitted:
                request.admitted = True
                request.cached_tokens = len(ids) - uncached
                self.stats.cached_tokens += request.cached_tokens
            self.stats.prefill_tokens += uncached
            new_tokens += uncached
        return new_tokens

    def _integrate(self) -> None:
        if self._mark is not None:
            now = time.monotonic()
            self.stats.running_seconds += len(self.running) * (now - self._mark)
            self._mark = now

    def _finish(self, request: Request, reason: dict[str, Any]) -> None:
        tokens, logprobs = request.output()
        self.cache.insert(request.input_ids + tokens)
        if reason["type"] == "abort":
            self.stats.num_aborted += 1
            self.stats.aborted_tokens += request.new
            if request.offset == 0 and request.new == 0:
                self.model.release(request.stream)
        if request.future.done():
            return
        meta = {
            "id": request.rid,
            "finish_reason": reason,
            "prompt_tokens": len(request.input_ids),
            "completion_tokens": len(tokens),
            "cached_tokens": request.cached_tokens,
            "weight_version": self.weight_version,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens, strict=True)],
            "e2e_latency": time.monotonic() - request.created,
        }
        text = f"<{len(tokens)} simulated tokens>"
        request.future.set_result({"text": text, "output_ids": tokens, "meta_info": meta})

    def abort(self, matches) -> int:
        self._integrate()
        hit = [r for r in [*self.waiting, *self.running] if matches(r)]
        for request in hit:
            message = "Abort in waiting queue" if request in self.waiting else "Abort running request"
            self._finish(request, {"type": "abort", "message": message})
        self.waiting = deque(r for r in self.waiting if not matches(r))
        self.running = [r for r in self.running if not matches(r)]
        return len(hit)

    def wake(self) -> None:
        self._wake.set()

    # -- HTTP ----------------------------------------------------------------------------------------
    async def generate(self, http: web.Request) -> web.Response:
        try:
            body = await http.json()
            input_ids = [int(t) for t in body["input_ids"]]
            params = body.get("sampling_params") or {}
            max_new_tokens = int(params.get("max_new_tokens", 128))
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"object": "error", "message": f"bad request: {exc!r}", "code": 400}, status=400)
        draw = self.faults.rng.random()  # one draw per request, in arrival order
        if draw < self.faults.error_rate:
            self.faults.injected_errors += 1
            status = self.faults.error_status
            return web.json_response(
                {"object": "error", "message": "injected server error", "code": status}, status=status
            )
        malformed = draw < self.faults.error_rate + self.faults.malformed_rate
        stream, offset = self.model.open_turn(input_ids)
        rid = str(body.get("rid") or uuid.uuid4().hex)
        request = Request(rid, input_ids, max_new_tokens, stream, offset, asyncio.get_running_loop().create_future())
        self.stats.num_requests += 1
        if max_new_tokens < 1:
            self._finish(request, {"type": "length", "length": 0})
        else:
            self.waiting.append(request)
            self.wake()
        try:
            reply = await request.future
        except asyncio.CancelledError:  # the client went away
            self.abort(lambda r: r is request)
            raise
        if malformed and reply["meta_info"]["finish_reason"]["type"] != "abort":
            self.faults.injected_malformed += 1
            return self._malformed(reply)
        return web.json_response(reply)

    def _malformed(self, reply: dict[str, Any]) -> web.Response:
        """A 200 reply that is not a generate reply, of a kind drawn from the fault generator."""
        kind = self.faults.rng.choice(MALFORMED_BODIES)
        if kind == "logprobs_mismatch" and not reply["output_ids"]:
            kind = "no_meta_info"  # no token to leave out
        if kind == "not_json":
            return web.Response(status=200, text=json.dumps(reply)[: len(json.dumps(reply)) // 2])  # cut short
        if kind == "no_meta_info":
            return web.json_response({"text": reply["text"], "output_ids": reply["output_ids"]})
        meta = {**reply["meta_info"], "output_token_logprobs": reply["meta_info"]["output_token_logprobs"][:-1]}
        return web.json_response({**reply, "meta_info": meta})

    async def abort_request(self, http: web.Request) -> web.Response:
        body = await _body(http)
        if body.get("abort_all"):
            self.abort(lambda r: True)
        elif body.get("rid"):
            self.abort(lambda r, prefix=str(body["rid"]): r.rid.startswith(prefix))
        return web.json_response({})

    async def pause_generation(self, http: web.Request) -> web.Response:
        mode = (await _body(http)).get("mode", "abort")
        if mode == "abort":
            self.abort(lambda r: True)
        elif mode == "retract":
            self._integrate()
            self.waiting.extendleft(reversed(self.running))
            self.running = []
        self.paused = True
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, http: web.Request) -> web.Response:
        self.paused = False
        self.wake()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(self, http: web.Request) -> web.Response:
        body = await _body(http)
        self.weight_version = str(body.get("weight_version") or _next_version(self.weight_version))
        if self.config.flush_on_update:
            self.cache.clear()
        message = "Succeeded to update model weights."
        return web.json_response({"success": True, "message": message, "num_paused_requests": len(self.waiting)})

    async def model_info(self, http: web.Request) -> web.Response:
        return web.json_response({"model_path": "sim", "is_generation": True, "weight_version": self.weight_version})

    async def health(self, http: web.Request) -> web.Response:
        return web.Response(status=200)

    async def server_info(self, http: web.Request) -> web.Response:
        return web.json_response({"simulated": True, **asdict(self.config), "weight_version": self.weight_version})

    async def get_model_info_deprecated(self, http: web.Request) -> web.Response:
        return await self.model_info(http)

    async def get_server_info_deprecated(self, http: web.Request) -> web.Response:
        return await self.server_info(http)

    async def get_stats(self, http: web.Request) -> web.Response:
        self._integrate()
        snapshot = self.stats.snapshot(self.config.max_running)
        snapshot.update(num_waiting=len(self.waiting), num_running=len(self.running), paused=self.paused)
        snapshot["injected"] = self.faults.counts()
        return web.json_response(snapshot)

    async def get_faults(self, http: web.Request) -> web.Response:
        return web.json_response({**self.faults.settings(), "injected": self.faults.counts()})

    async def set_faults(self, http: web.Request) -> web.Response:
        body = await _body(http)
        unknown = set(body) - set(FAULT_KEYS)
        if unknown:
            message = f"unknown fault settings {sorted(unknown)}; known: {list(FAULT_KEYS)}"
            return web.json_response({"object": "error", "message": message, "code": 400}, status=400)
        settings = {**self.faults.settings(), **body}
        counts = (self.faults.injected_errors, self.faults.injected_malformed)
        self.faults = Faults(
            error_rate=float(settings["error_rate"]), malformed_rate=float(settings["malformed_rate"]),
            error_status=int(settings["error_status"]), fault_seed=int(settings["fault_seed"]),
        )  # fmt: skip
        self.faults.injected_errors, self.faults.injected_malformed = counts
        return web.json_response(self.faults.settings())

    async def reset_stats(self, http: web.Request) -> web.Response:
        self._integrate()
        self.faults.injected_errors = self.faults.injected_malformed = 0
        self.stats = Stats()
        if self._mark is not None:
            self._mark = self.stats.started
        return web.json_response({})

    async def sim_reset(self, http: web.Request) -> web.Response:
        self.reset_state(str((await _body(http)).get("weight_version", self.config.weight_version)))
        return web.json_response({})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        routes = [
            ("POST", "/generate", self.generate),
            ("POST", "/abort_request", self.abort_request),
            ("POST", "/pause_generation", self.pause_generation),
            ("POST", "/continue_generation", self.continue_generation),
            ("POST", "/update_weights_from_disk", self.update_weights_from_disk),
            ("GET", "/model_info", self.model_info),
            ("GET", "/health", self.health),
            ("GET", "/health_generate", self.health),
            ("GET", "/server_info", self.server_info),
            ("GET", "/get_model_info", self.get_model_info_deprecated),
            ("GET", "/get_server_info", self.get_server_info_deprecated),
            ("GET", "/sim/faults", self.get_faults),
            ("POST", "/sim/faults", self.set_faults),
            ("GET", "/stats", self.get_stats),
            ("POST", "/stats/reset", self.reset_stats),
            ("POST", "/sim/reset", self.sim_reset),
        ]
        app.add_routes([web.route(method, path, handler) for method, path, handler in routes])
        return app


def _next_version(version: str) -> str:
    """v3 -> v4, 7 -> 8; anything else -> "1"."""
    prefix, digits = version.rstrip("0123456789"), version[len(version.rstrip("0123456789")) :]
    return f"{prefix}{int(digits) + 1}" if digits else "1"


async def _body(http: web.Request) -> dict[str, Any]:
    if not http.can_read_body:
        return {}
    body = await http.json()
    return body if isinstance(body, dict) else {}


async def serve(config: SimConfig, host: str, port: int) -> None:
    server = SimServer(config)
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)  # a client gone: abort
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"listening on http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop_task = asyncio.create_task(server.batch_loop())
    try:
        await stop.wait()
    finally:
        loop_task.cancel()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0: any free port (printed)")
    defaults = SimConfig()
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    host, port = args.pop("host"), args.pop("port")
    asyncio.run(serve(SimConfig(**args), host, port))


if __name__ == "__main__":
    main()
