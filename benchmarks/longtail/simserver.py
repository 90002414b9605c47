"""A simulated SGLang server: SGLang 0.5's HTTP API, continuous-batching timing, a deterministic "model".

    python -m benchmarks.longtail.simserver --port 0 --max-running 128  # prints "listening on http://127.0.0.1:PORT"
    with sim_server(SimConfig(max_running=16)) as url: ...             # the same, from a benchmark or a test

Timing. One asyncio task runs the batch loop. A step admits waiting requests (up to `max_running`
running, and `max_prefill_tokens` new tokens), then lasts

    prefill_s_per_token * uncached_new_tokens + decode_a + decode_b * running

(an asyncio.sleep stands in for the GPU; overshoot is paid back in the next step), after which every
running request has one more token. The loop's own work between two steps is paid back the same way,
so a busy spell's running and busy seconds (`GET /stats`) run on through it, as a GPU's running batch
would. A prefix cache of 16-token blocks (chain hash, LRU) stands in for SGLang's radix cache: a request
extending an earlier one pays prefill for its new part only. A weight update flushes it, as SGLang's does.

The model (model.py's TurnModel) makes every policy see the same work: a turn's length and tokens
depend on the conversation up to the turn's start only, and an aborted turn resumed later continues
the same stream. Text is a placeholder; clients decode `output_ids` themselves.

Streaming: a /generate request with `"stream": true` is answered as SGLang streams it (engine/backends/sglang_stream.py
says what the chunks hold): a chunk each time the request's output grows, paced as its tokens are made (the one
server: each step; many servers: each token's due time at the current pace), cumulative or, with
`incremental_streaming_output` (SGLang's `--incremental-streaming-output`), only what is new (and no text), the last
one holding the finish reason, then `data: [DONE]`. Each chunk's meta_info has `first_chunk_at`: the
`time.monotonic()` (this machine's clock) at which the first chunk was sent, so a client can measure its delay. An
injected error is answered before any chunk; a streamed reply is never malformed.

Endpoints: POST /generate, /abort_request, /pause_generation, /continue_generation,
/update_weights_from_disk; GET /model_info, /v1/loads, /health, /health_generate, /server_info (and the deprecated
/get_model_info, /get_server_info, which sglang-router reads when a worker registers); and for
the benchmark GET /stats (measurements since the last POST /stats/reset) and POST /sim/reset (abort
everything, forget the model's and the cache's state, set the weight version).

Fault injection (benchmarks/faults/suite.py), off by default: with `error_rate` a /generate request is answered
at once with HTTP `error_status` (an overloaded or failing server); with `malformed_rate` one is generated
in full (its tokens count as generated) and then answered with HTTP 200 and a body that is not a generate
reply (not JSON, or JSON without meta_info, or log-probs that do not match the tokens). Which requests
fail is drawn from a generator seeded with `fault_seed`, in the order requests arrive. POST /sim/faults
{"error_rate", "malformed_rate", "error_status", "fault_seed"} changes them while the server runs (the
generator is seeded again); GET /sim/faults gives them and how many of each were injected since the last
POST /stats/reset (also in /stats, as `injected`).

Many servers (`--kv-tokens N --servers S`): one process serves S simulated servers, server i under the path
prefix `/s/i` (`http://127.0.0.1:PORT/s/3` is a server's URL: `/s/3/generate`, `/s/3/get_load`, ...), all sharing
the one model, so a trajectory continues the same way on whichever server serves its next turn. Each server has a
KV cache of `kv_tokens` tokens (`KVCache`): a running request holds its prompt and the tokens it will generate,
and must fit, else it waits; what finished requests leave is a prefix cache over token ids (16-token blocks
chained by hash, a radix tree's paths) evicted least recently used first, deepest blocks first. A request pays
prefill only for its uncached tokens and its reply's `meta_info.cached_tokens` says how many were cached. Time is
kept by events, not steps (`CachedServer`): running requests advance together at one token per
`decode_a + decode_b * running` seconds, stalled while a prefill of `prefill_s_per_token` per uncached token runs;
one timer per server fires at the next finish. `GET /s/i/get_load` answers as SGLang's `/get_load` did (one
entry per data-parallel rank: `num_reqs`, `num_waiting_reqs`, `num_tokens`), `GET /s/i/v1/loads` as SGLang 0.5.x's
`/v1/loads` does (its `core` section); `GET /stats` gives each server's
measurements and their sum (these also count `waiting_seconds`, the time-integral of requests waiting, and
`blocked_slot_seconds`, of slots free while the queue's head waits for KV room; `kv_blocked_share` is the latter
over all slot time), `POST /stats/reset` and `POST /sim/reset` act on every server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import json
import math
import os
import random
import select
import signal
import subprocess
import sys
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import orjson
from aiohttp import web

from benchmarks.longtail.model import IM_END, PrefixCache, Request, Stats, Stream, TurnModel

MAX_DEBT_S = 0.005
REPO = Path(__file__).resolve().parents[2]


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
    # many servers in one process (see "Many servers" in the module docstring); 0: the one server above
    kv_tokens: int = 0  # each server's KV-cache capacity in tokens: running requests' and cached prefixes'
    servers: int = 1
    incremental_streaming_output: bool = False  # streamed chunks hold only what is new, as with SGLang's flag


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


class ChunkStream:
    """A streamed /generate reply in SGLang's format (see the module docstring): `send` each reply-shaped output
    so far (finish_reason None while it runs), then `end`."""

    def __init__(self, response: web.StreamResponse, incremental: bool):
        self.response, self.incremental = response, incremental
        self.sent = 0  # tokens sent
        self.first_at: float | None = None

    @classmethod
    async def open(cls, http: web.Request, incremental: bool) -> ChunkStream:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(http)
        return cls(response, incremental)

    async def send(self, reply: dict[str, Any]) -> None:
        """A chunk of `reply`, unless it holds nothing new and does not end the stream."""
        tokens, meta = reply["output_ids"], reply["meta_info"]
        if len(tokens) == self.sent and meta["finish_reason"] is None:
            return
        if self.incremental:
            entries = meta["output_token_logprobs"][self.sent :]
            meta = {**meta, "output_token_logprobs": entries}
            reply = {**reply, "text": "", "output_ids": tokens[self.sent :], "meta_info": meta}
        if self.first_at is None:
            self.first_at = time.monotonic()
        reply["meta_info"] = {**reply["meta_info"], "first_chunk_at": self.first_at}
        await self.response.write(b"data: " + orjson.dumps(reply) + b"\n\n")
        self.sent = len(tokens)

    async def end(self) -> web.StreamResponse:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response


class SimServer:
    def __init__(self, config: SimConfig):
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.paused = False
        self._wake = asyncio.Event()
        self._mark: float | None = None  # while a step runs: the time up to which the measurements are counted
        self._counted = 0.0  # where the last step's count ended
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
        self._restart_stats()

    def _restart_stats(self) -> None:
        self.stats = Stats()
        self._counted = max(self._counted, self.stats.started)
        if self._mark is not None:
            self._mark = self.stats.started

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
            # The step is [base, deadline] of the model's time, and the loop's own work between two steps is paid for
            # by the second's shorter sleep: so within a busy spell the count goes on from where the last step's ended.
            self._mark = max(base, self._counted)
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            self._integrate()
            self._counted, self._mark = self._mark, None
            self.stats.num_steps += 1
            self.stats.generated_tokens += len(self.running)
            still = []
            for request in self.running:
                request.new += 1
                if request.advanced is not None:
                    request.advanced.set()
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
            self.stats.busy_seconds += now - self._mark
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
        request.future.set_result(self.reply(request, reason))
        if request.advanced is not None:
            request.advanced.set()

    def reply(self, request: Request, reason: dict[str, Any] | None) -> dict[str, Any]:
        """A /generate reply of what `request` has generated (a streamed chunk of it, while `reason` is None)."""
        tokens, logprobs = request.output()
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
        return {"text": f"<{len(tokens)} simulated tokens>", "output_ids": tokens, "meta_info": meta}

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
        if body.get("stream"):
            request.advanced = asyncio.Event()
        if max_new_tokens < 1:
            self._finish(request, {"type": "length", "length": 0})
        else:
            self.waiting.append(request)
            self.wake()
        try:
            if body.get("stream"):
                return await self._stream(http, request)
            reply = await request.future
        except (asyncio.CancelledError, ConnectionError):  # the client went away
            self.abort(lambda r: r is request)
            raise
        if malformed and reply["meta_info"]["finish_reason"]["type"] != "abort":
            self.faults.injected_malformed += 1
            return self._malformed(reply)
        return web.json_response(reply)

    async def _stream(self, http: web.Request, request: Request) -> web.StreamResponse:
        """`request`'s reply streamed: a chunk after each step that gave it a token, the reply itself last."""
        stream = await ChunkStream.open(http, self.config.incremental_streaming_output)
        while not request.future.done():
            await request.advanced.wait()
            request.advanced.clear()
            if not request.future.done():
                await stream.send(self.reply(request, None))
        await stream.send(request.future.result())
        return await stream.end()

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

    async def v1_loads(self, http: web.Request) -> web.Response:
        """As SGLang 0.5.x's GET /v1/loads (its `core` section; no KV is modelled here, so no token usage)."""
        rank = {"dp_rank": 0, "num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
                "max_running_requests": self.config.max_running, "token_usage": 0.0}  # fmt: skip
        return web.json_response({"version": "sim", "loads": [rank]})

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
        self._restart_stats()
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
            ("GET", "/v1/loads", self.v1_loads),
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


# -- many servers in one process: KV capacity, a prefix cache, event-driven timing ------------------------------
BLOCK = 16


def chain(ids: Sequence[int], parent: int = 0) -> list[int]:
    """The hashes of `ids`' full 16-token blocks, each chained over the ones before it from `parent`."""
    hashes, h = [], parent
    for i in range(0, len(ids) - BLOCK + 1, BLOCK):
        h = hash((h, *ids[i : i + BLOCK]))
        hashes.append(h)
    return hashes


@dataclass(frozen=True, slots=True)
class Lease:
    """What a running request holds: the cached blocks it reuses, and blocks of its own."""

    prefix: list[int]
    num_private: int


class KVCache:
    """One server's KV memory in 16-token blocks: blocks running requests hold (a shared prefix counted once),
    and cached blocks no request holds, evicted least recently used first. A block is named by its chain hash,
    so a cached block is a path of a radix tree over token ids; the weight epoch seeds the chain, so a weight
    update makes every older block unreachable (and first out)."""

    def __init__(self, capacity_tokens: int):
        self.capacity = max(1, capacity_tokens // BLOCK)
        self.holders: dict[int, int] = {}  # cached block -> running requests holding it
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks none holds, least recent first
        self.num_private = 0  # blocks running requests hold of their own (uncached prompt, output)
        self.num_evicted = 0

    @property
    def num_used(self) -> int:
        return len(self.holders) + self.num_private

    def num_cached(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are cached."""
        n = 0
        for h in hashes:
            if h not in self.holders:
                break
            n += 1
        return n

    def allocate(self, hashes: list[int], num_tokens: int) -> Lease | None:
        """Hold the cached prefix of a request of `num_tokens` tokens (prompt and output) whose prompt's blocks
        are `hashes`, and room for the rest, evicting as needed; None when it cannot fit now."""
        cached = self.num_cached(hashes)
        prefix = hashes[:cached]
        private = max(0, math.ceil(num_tokens / BLOCK) - cached)
        reused_evictable = sum(1 for h in prefix if self.holders[h] == 0)
        if self.capacity - self.num_used + len(self.evictable) - reused_evictable < private:
            return None
        for h in prefix:
            if self.holders[h] == 0:
                del self.evictable[h]
            self.holders[h] += 1
        self._evict(private)
        self.num_private += private
        return Lease(prefix, private)

    def release(self, lease: Lease, hashes: list[int]) -> None:
        """A request ended: `hashes` (its prompt's and output's full blocks) stay cached, deepest first out."""
        for h in lease.prefix:
            self.holders[h] -= 1
        self.num_private -= lease.num_private
        for h in reversed(hashes):  # deepest first, so the deepest ends up least recent: evicted before its prefix
            if self.holders.setdefault(h, 0) == 0:
                self.evictable[h] = None
                self.evictable.move_to_end(h)
        self._evict(0)

    def _evict(self, room: int) -> None:
        while self.capacity - self.num_used < room and self.evictable:
            h, _ = self.evictable.popitem(last=False)
            del self.holders[h]
            self.num_evicted += 1

    def clear(self) -> None:
        for h in self.evictable:
            del self.holders[h]
        self.evictable.clear()


@dataclass(slots=True)
class FleetStats(Stats):
    """A `CachedServer`'s measurements: a `Stats`, and what waits to be admitted."""

    waiting_seconds: float = 0.0  # time-integral of requests waiting to be admitted
    blocked_slot_seconds: float = 0.0  # time-integral of free slots while requests wait (no KV room for the head)


@dataclass(slots=True, eq=False)
class Job:
    """A request on a `CachedServer`: it generates `num_tokens` of `stream` from `offset` on."""

    rid: str
    input_ids: list[int]
    stream: Stream
    offset: int
    num_tokens: int
    finish_type: str  # "length" or "stop", when all num_tokens are out
    future: asyncio.Future
    created: float
    hashes: list[int] = field(default_factory=list)
    lease: Lease | None = None
    cached_tokens: int = 0
    started_v: float = 0.0
    is_running: bool = False


class CachedServer:
    """One simulated server with a KV capacity and a prefix cache, timed by events (see the module docstring)."""

    def __init__(self, config: SimConfig, model: TurnModel, index: int = 0):
        self.config, self.model, self.index = config, model, index
        self.cache = KVCache(config.kv_tokens)
        self.epoch = 0  # weight updates so far: seeds the block chain
        self.weight_version = config.weight_version
        self.waiting: deque[Job] = deque()
        self.running: set[Job] = set()
        self._finishing: list[tuple[float, int, Job]] = []  # (v at which it ends, serial, job); lazily pruned
        self._serial = itertools.count()
        self.paused = False
        self.v = 0.0  # tokens each running request has advanced by, since the server started
        self._last = time.monotonic()
        self._stall_until = 0.0  # a prefill runs until then: no decoding
        self._timer: asyncio.TimerHandle | None = None
        self._kv_blocked = False  # the head of the queue waits for KV room (as of the last admission)
        self.stats = FleetStats()

    # -- time --------------------------------------------------------------------------------------------------
    def _step_seconds(self) -> float:
        return self.config.decode_a + self.config.decode_b * len(self.running)

    def _advance(self, now: float) -> None:
        """Bring `v` and the measurements up to `now` (the running set has not changed since `_last`)."""
        elapsed = now - self._last
        if elapsed <= 0:
            return
        if self.waiting:
            self.stats.waiting_seconds += len(self.waiting) * elapsed
            if self._kv_blocked and not self.paused:
                self.stats.blocked_slot_seconds += (self.config.max_running - len(self.running)) * elapsed
        if self.running:
            self.stats.running_seconds += len(self.running) * elapsed
            self.stats.busy_seconds += elapsed
            if not self.paused:
                decoding = now - max(self._last, min(self._stall_until, now))
                self.v += decoding / self._step_seconds()
        self._last = now

    def progress(self) -> float:
        """Tokens each running request has advanced by since the server started, as of now."""
        self._advance(time.monotonic())
        return self.v

    def _settle(self) -> None:
        """Finish what is due, admit what fits, and set the timer for the next finish."""
        now = time.monotonic()
        self._advance(now)
        while self._finishing and self._finishing[0][0] <= self.v + 1e-6:
            _, _, job = heapq.heappop(self._finishing)
            if job.is_running:
                self._end(job, job.num_tokens, {"type": job.finish_type})
        if not self.paused:
            self._admit(now)
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._finishing and not self._finishing[0][2].is_running:
            heapq.heappop(self._finishing)
        if self.paused or not self._finishing:
            return
        start = max(now, self._stall_until)
        when = start + max(0.0, self._finishing[0][0] - self.v) * self._step_seconds()
        self._timer = asyncio.get_running_loop().call_later(max(0.0, when - now), self._settle)

    def _admit(self, now: float) -> None:
        uncached = 0
        self._kv_blocked = False
        while self.waiting and len(self.running) < self.config.max_running:
            job = self.waiting[0]
            job.hashes = chain(job.input_ids, self.epoch)
            lease = self.cache.allocate(job.hashes, len(job.input_ids) + job.num_tokens)
            if lease is None:
                self._kv_blocked = True
                break  # first come, first served: the head waits for room
            self.waiting.popleft()
            job.lease, job.is_running, job.started_v = lease, True, self.v
            job.cached_tokens = min(len(lease.prefix) * BLOCK, len(job.input_ids) - 1)
            uncached += len(job.input_ids) - job.cached_tokens
            self.stats.cached_tokens += job.cached_tokens
            self.running.add(job)
            heapq.heappush(self._finishing, (self.v + job.num_tokens, next(self._serial), job))
        if uncached:
            self.stats.prefill_tokens += uncached
            self._stall_until = max(now, self._stall_until) + self.config.prefill_s_per_token * uncached

    def _end(self, job: Job, num_generated: int, reason: dict[str, Any]) -> None:
        """The one place a job ends: its blocks cached, its reply sent."""
        if job.is_running:
            self.running.discard(job)
            job.is_running = False
            tokens = job.stream.tokens[job.offset : job.offset + num_generated]
            self.cache.release(job.lease, chain([*job.input_ids, *tokens.tolist()], self.epoch))
        self.stats.generated_tokens += num_generated
        if reason["type"] == "abort":
            self.stats.num_aborted += 1
            self.stats.aborted_tokens += num_generated
            if job.offset == 0 and num_generated == 0:
                self.model.release(job.stream)
        if not job.future.done():
            job.future.set_result(self._reply(job, num_generated, reason))

    def _reply(self, job: Job, n: int, reason: dict[str, Any] | None) -> dict[str, Any]:
        window = slice(job.offset, job.offset + n)
        tokens, logprobs = job.stream.tokens[window].tolist(), job.stream.logprobs[window].tolist()
        kind = None if reason is None else reason["type"]  # None: a streamed chunk, the request still running
        if kind == "length":
            reason = {"type": "length", "length": n}
        elif kind == "stop":
            reason = {"type": "stop", "matched": IM_END}
        meta = {
            "id": job.rid, "finish_reason": reason, "prompt_tokens": len(job.input_ids), "completion_tokens": n,
            "cached_tokens": job.cached_tokens, "weight_version": self.weight_version,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens, strict=True)],
            "e2e_latency": time.monotonic() - job.created,
        }  # fmt: skip
        return {"text": f"<{n} simulated tokens>", "output_ids": tokens, "meta_info": meta}

    def num_made(self, job: Job) -> int:
        """Tokens `job` has made by now."""
        if not job.is_running:
            return 0
        return min(int(self.progress() - job.started_v + 1e-6), job.num_tokens)

    def progress_reply(self, job: Job) -> dict[str, Any]:
        """A streamed chunk of what `job` has made by now."""
        return self._reply(job, self.num_made(job), None)

    def next_token_in(self, job: Job) -> float:
        """Seconds until `job`'s next token at the pace of now (which changes as requests come and go)."""
        now = time.monotonic()
        made = self.progress() - job.started_v if job.is_running else 0.0
        return max(self._stall_until - now, 0.0) + (math.floor(made + 1e-6) + 1 - made) * self._step_seconds()

    # -- requests ----------------------------------------------------------------------------------------------
    def submit(self, rid: str, input_ids: list[int], max_new_tokens: int) -> Job:
        stream, offset = self.model.open_turn(input_ids)
        remaining = len(stream.tokens) - offset
        num_tokens = max(0, min(max_new_tokens, remaining))
        finish_type = "length" if num_tokens == max_new_tokens else "stop"
        future = asyncio.get_running_loop().create_future()
        job = Job(rid, input_ids, stream, offset, num_tokens, finish_type, future, time.monotonic())
        self.stats.num_requests += 1
        if num_tokens == 0:
            self._end(job, 0, {"type": finish_type})
        else:
            self._advance(time.monotonic())
            self.waiting.append(job)
            self._settle()
        return job

    def abort(self, matches) -> int:
        self._advance(time.monotonic())
        hit = [job for job in [*self.waiting, *self.running] if matches(job)]
        self.waiting = deque(job for job in self.waiting if not matches(job))
        for job in hit:
            generated = int(self.v - job.started_v + 1e-6) if job.is_running else 0
            message = "Abort running request" if job.is_running else "Abort in waiting queue"
            self._end(job, min(max(generated, 0), job.num_tokens), {"type": "abort", "message": message})
        self._settle()
        return len(hit)

    def pause(self, mode: str) -> None:
        """Mode "in_place" holds running requests until `resume`; "abort" aborts every request first."""
        if mode == "abort":
            self.abort(lambda job: True)
        self._advance(time.monotonic())
        self.paused = True
        self._schedule(time.monotonic())

    def resume(self) -> None:
        self._advance(time.monotonic())
        self.paused = False
        self._settle()

    def update_weights(self, version: str) -> None:
        self.weight_version = version
        self.epoch += 1
        self.cache.clear()

    def load(self) -> list[dict[str, Any]]:
        """As SGLang's GET /get_load: one entry per data-parallel rank (one here); `num_tokens` is the KV the
        running requests hold (cached blocks no request holds are free to evict, so they do not count)."""
        tokens = (self.cache.num_used - len(self.cache.evictable)) * BLOCK
        return [{"dp_rank": 0, "num_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
                 "num_tokens": tokens}]  # fmt: skip

    def v1_load(self) -> dict[str, Any]:
        """As one rank of SGLang 0.5.x's GET /v1/loads (`core`): `token_usage` is the KV running requests hold."""
        used = self.cache.num_used - len(self.cache.evictable)  # blocks running requests hold
        held = used / self.cache.capacity if self.cache.capacity else 0.0
        return {"dp_rank": 0, "num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
                "max_running_requests": self.config.max_running, "token_usage": round(held, 4),
                "num_used_tokens": used * BLOCK}  # fmt: skip

    def snapshot(self) -> dict[str, Any]:
        self._advance(time.monotonic())
        out = self.stats.snapshot(self.config.max_running)
        out.update(
            num_running=len(self.running), num_waiting=len(self.waiting), paused=self.paused,
            kv_used_tokens=self.cache.num_used * BLOCK, kv_capacity_tokens=self.cache.capacity * BLOCK,
            num_evicted_blocks=self.cache.num_evicted,
        )  # fmt: skip
        return out

    def reset_stats(self) -> None:
        self._advance(time.monotonic())
        self.stats = FleetStats()
        self.cache.num_evicted = 0


SUMMED = ("running_seconds", "busy_seconds", "num_requests", "num_aborted", "generated_tokens", "aborted_tokens",
          "prefill_tokens", "cached_tokens", "num_running", "num_waiting", "num_evicted_blocks",
          "waiting_seconds", "blocked_slot_seconds")  # fmt: skip


class Fleet:
    """`servers` CachedServers behind one HTTP app, server i under `/s/i` (see the module docstring)."""

    def __init__(self, config: SimConfig):
        self.config = config
        self.reset(config.weight_version)

    def reset(self, weight_version: str) -> None:
        for server in getattr(self, "servers", ()):
            server.abort(lambda job: True)
        cfg = self.config
        model = TurnModel(cfg.seed, cfg.median_tokens, cfg.sigma, cfg.max_turn_tokens)
        config = SimConfig(**{**asdict(cfg), "weight_version": weight_version})
        self.servers = [CachedServer(config, model, i) for i in range(cfg.servers)]

    def _server(self, http: web.Request) -> CachedServer:
        index = int(http.match_info["index"])
        if not 0 <= index < len(self.servers):
            raise web.HTTPNotFound(text=f"no simulated server {index}; there are {len(self.servers)}")
        return self.servers[index]

    async def generate(self, http: web.Request) -> web.Response:
        server = self._server(http)
        try:
            body = orjson.loads(await http.read())
            input_ids = [int(t) for t in body["input_ids"]]
            max_new_tokens = int((body.get("sampling_params") or {}).get("max_new_tokens", 128))
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"object": "error", "message": f"bad request: {exc!r}", "code": 400}, status=400)
        rid = str(body.get("rid") or uuid.uuid4().hex)
        job = server.submit(rid, input_ids, max_new_tokens)
        try:
            if body.get("stream"):
                return await self._stream(http, server, job)
            reply = await job.future
        except (asyncio.CancelledError, ConnectionError):  # the client went away
            server.abort(lambda running: running is job)
            raise
        return web.Response(body=orjson.dumps(reply), content_type="application/json")

    async def _stream(self, http: web.Request, server: CachedServer, job: Job) -> web.StreamResponse:
        """`job`'s reply streamed: a chunk at each token's due time, the reply itself last."""
        stream = await ChunkStream.open(http, self.config.incremental_streaming_output)
        while not job.future.done():
            await asyncio.wait([job.future], timeout=server.next_token_in(job))
            if not job.future.done():
                await stream.send(server.progress_reply(job))
        await stream.send(job.future.result())
        return await stream.end()

    async def abort_request(self, http: web.Request) -> web.Response:
        server, body = self._server(http), await _body(http)
        if body.get("abort_all"):
            server.abort(lambda job: True)
        elif body.get("rid"):
            server.abort(lambda job, prefix=str(body["rid"]): job.rid.startswith(prefix))
        return web.json_response({})

    async def pause_generation(self, http: web.Request) -> web.Response:
        server, mode = self._server(http), (await _body(http)).get("mode", "abort")
        if mode not in ("abort", "in_place"):
            message = f"pause mode {mode!r} is not simulated with many servers; use 'abort' or 'in_place'"
            return web.json_response({"object": "error", "message": message, "code": 400}, status=400)
        server.pause(mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, http: web.Request) -> web.Response:
        self._server(http).resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(self, http: web.Request) -> web.Response:
        server, body = self._server(http), await _body(http)
        server.update_weights(str(body.get("weight_version") or _next_version(server.weight_version)))
        message = "Succeeded to update model weights."
        return web.json_response({"success": True, "message": message, "num_paused_requests": len(server.waiting)})

    async def get_load(self, http: web.Request) -> web.Response:
        return web.json_response(self._server(http).load())

    async def v1_loads(self, http: web.Request) -> web.Response:
        return web.json_response({"version": "sim", "loads": [self._server(http).v1_load()]})

    async def model_info(self, http: web.Request) -> web.Response:
        version = self._server(http).weight_version
        return web.json_response({"model_path": "sim", "is_generation": True, "weight_version": version})

    async def health(self, http: web.Request) -> web.Response:
        self._server(http)
        return web.Response(status=200)

    async def server_info(self, http: web.Request) -> web.Response:
        server = self._server(http)
        return web.json_response({"simulated": True, **asdict(server.config), "weight_version": server.weight_version})

    async def get_stats(self, http: web.Request) -> web.Response:
        each = [server.snapshot() for server in self.servers]
        total = {key: sum(s[key] for s in each) for key in SUMMED}
        wall = max(s["wall_seconds"] for s in each)
        capacity = self.config.max_running * len(each) * wall
        total.update(
            wall_seconds=wall, servers=len(each), max_running=self.config.max_running,
            utilization=total["running_seconds"] / capacity if capacity else 0.0,
            kv_blocked_share=total["blocked_slot_seconds"] / capacity if capacity else 0.0,
            busy_fraction=total["busy_seconds"] / (len(each) * wall) if wall else 0.0,
            mean_batch_size=total["running_seconds"] / total["busy_seconds"] if total["busy_seconds"] else 0.0,
        )  # fmt: skip
        return web.json_response({**total, "per_server": each})

    async def reset_stats(self, http: web.Request) -> web.Response:
        for server in self.servers:
            server.reset_stats()
        return web.json_response({})

    async def sim_reset(self, http: web.Request) -> web.Response:
        self.reset(str((await _body(http)).get("weight_version", self.config.weight_version)))
        return web.json_response({})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        per_server = [
            ("POST", "generate", self.generate),
            ("POST", "abort_request", self.abort_request),
            ("POST", "pause_generation", self.pause_generation),
            ("POST", "continue_generation", self.continue_generation),
            ("POST", "update_weights_from_disk", self.update_weights_from_disk),
            ("GET", "get_load", self.get_load),
            ("GET", "v1/loads", self.v1_loads),
            ("GET", "model_info", self.model_info),
            ("GET", "get_model_info", self.model_info),
            ("GET", "server_info", self.server_info),
            ("GET", "get_server_info", self.server_info),
            ("GET", "health", self.health),
            ("GET", "health_generate", self.health),
        ]
        routes = [web.route(method, "/s/{index:\\d+}/" + path, handler) for method, path, handler in per_server]
        routes += [
            web.get("/stats", self.get_stats),
            web.post("/stats/reset", self.reset_stats),
            web.post("/sim/reset", self.sim_reset),
        ]
        app.add_routes(routes)
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
    server: SimServer | Fleet = Fleet(config) if config.kv_tokens > 0 else SimServer(config)
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)  # a client gone: abort
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)  # thousands of clients may connect at once
    await site.start()
    bound = runner.addresses[0][1]
    print(f"listening on http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop_task = asyncio.create_task(server.batch_loop()) if isinstance(server, SimServer) else None
    try:
        await stop.wait()
    finally:
        if loop_task is not None:
            loop_task.cancel()
        await runner.cleanup()


# -- one in a process of its own, for the benchmarks and tests: sim_server, sim_post ----------------------------------


@contextlib.contextmanager
def sim_server(config: SimConfig, *, timeout: float = 30.0) -> Iterator[str]:
    """Start `python -m benchmarks.longtail.simserver` on a free port; yields its URL; stops it at exit."""
    flags = []
    for name, value in asdict(config).items():
        flag = "--" + name.replace("_", "-")
        flags += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "benchmarks.longtail.simserver", "--port", "0", *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        line = process.stdout.readline() if ready else ""
        if not line.startswith("listening on "):
            raise RuntimeError(f"the simulated server did not start (exit code {process.poll()}, said {line!r})")
        yield line.split()[-1]
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def sim_post(url: str, path: str, body: dict[str, Any] | None = None) -> None:
    """POST to the simulated server's control endpoints (/sim/reset, /stats/reset)."""
    async with httpx2.AsyncClient(base_url=url, trust_env=False) as client:
        (await client.post(path, json=body or {})).raise_for_status()


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
