"""A fault-injecting HTTP proxy in front of a real SGLang server: the fault suite's server-side faults
(`python -m benchmarks.faults --sglang`) corrupt what the real server answers, not a simulation of it.

    async with FaultProxy("http://127.0.0.1:30000") as proxy:     # listens on a free loopback port
        proxy.set_faults(ProxyFaults(error_rate=0.05, seed=0))
        ... SGLangBackend(proxy.url) ...
        proxy.injected     # {"server_error": 3, "malformed": 0}
        proxy.forwarded    # requests that reached the server, by "METHOD /path"

    python -m benchmarks.faults.proxy --upstream http://127.0.0.1:30000 --port 31000 --error-rate 0.05

Every request (any method and path: /generate, /abort_request, /pause_generation, /continue_generation,
/update_weights_from_disk, /model_info, /health, /workers, ...) is forwarded to the server as it came, and the
server's reply comes back as it was sent, except for a share of POST /generate, drawn one per request in
arrival order from a generator seeded with `seed`:

  error_rate       answered at once with HTTP `error_status` and SGLang's error body, without reaching the
                   server (an overloaded or failing server)
  malformed_rate   forwarded and generated in full, then the server's reply corrupted, one kind drawn per
                   reply: cut in half (not JSON), its meta_info removed, or one log-prob fewer than tokens
                   (the kinds benchmarks/longtail/simserver.py injects). A reply that is not a success, or whose
                   finish reason is abort, is passed on unchanged: there is nothing generated to corrupt.

When the server cannot be reached, or drops the connection before replying (it was killed), the proxy drops
the client's connection without a reply, so a dead server behind the proxy looks to the client like a dead
server, not like a proxy's HTTP 502. The proxy runs in the caller's asyncio event loop (aiohttp's server, httpx
to the server), so its counts are plain attributes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
from collections import Counter
from dataclasses import dataclass

import httpx2
from aiohttp import web

MALFORMED_KINDS = ("not_json", "no_meta_info", "logprobs_mismatch")
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "host",
     "content-length", "content-encoding"}
)  # fmt: skip
UPSTREAM_TIMEOUT_S = 600.0  # the client's own timeout decides; the proxy waits as long as a generation may take


@dataclass(frozen=True, slots=True)
class ProxyFaults:
    """What the proxy injects into POST /generate (see the module docstring); nothing by default."""

    error_rate: float = 0.0
    malformed_rate: float = 0.0
    error_status: int = 503
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("error_rate", "malformed_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {value}")
        if self.error_rate + self.malformed_rate > 1.0:
            raise ValueError(
                f"error_rate + malformed_rate must be at most 1, got {self.error_rate + self.malformed_rate}"
            )
        if not 500 <= self.error_status <= 599:
            raise ValueError(f"error_status must be a 5xx status, got {self.error_status}")


class FaultProxy:
    """A reverse proxy to `upstream` on `host:port` (0: a free port); see the module docstring."""

    def __init__(self, upstream: str, *, host: str = "127.0.0.1", port: int = 0, faults: ProxyFaults = ProxyFaults()):
        self.upstream, self.host, self.port = upstream.rstrip("/"), host, port
        self.injected: Counter[str] = Counter()
        self.forwarded: Counter[str] = Counter()
        self.dropped = 0  # client connections dropped because the server could not be reached or went away
        self.set_faults(faults)
        self._client: httpx2.AsyncClient | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def set_faults(self, faults: ProxyFaults) -> None:
        """Inject `faults` from now on; the generator is seeded again. The counts are kept (see `reset_counts`)."""
        self.faults, self._rng = faults, random.Random(faults.seed)

    def reset_counts(self) -> None:
        self.injected.clear()
        self.forwarded.clear()
        self.dropped = 0

    async def __aenter__(self) -> FaultProxy:
        self._client = httpx2.AsyncClient(
            base_url=self.upstream, timeout=UPSTREAM_TIMEOUT_S, trust_env=False,
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=64),
        )  # fmt: skip
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the port bound, when 0 was asked for
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.aclose()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        is_generate = request.method == "POST" and request.path == "/generate"
        draw = self._rng.random() if is_generate else 1.0  # one draw per /generate request, in arrival order
        if draw < self.faults.error_rate:
            self.injected["server_error"] += 1
            status = self.faults.error_status
            return web.json_response({"object": "error", "message": "injected server error", "code": status},
                                     status=status)  # fmt: skip
        try:
            reply = await self._forward(request)
        except httpx2.TransportError:
            return self._drop(request)
        if is_generate and draw < self.faults.error_rate + self.faults.malformed_rate:
            corrupted = self._corrupt(reply)
            if corrupted is not None:
                self.injected["malformed"] += 1
                return corrupted
        headers = {k: v for k, v in reply.headers.items() if k.lower() not in HOP_BY_HOP}
        return web.Response(status=reply.status_code, body=reply.content, headers=headers)

    async def _forward(self, request: web.Request) -> httpx2.Response:
        if self._client is None:
            raise RuntimeError("FaultProxy forwards only inside `async with FaultProxy(...)`")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        body = await request.read()
        reply = await self._client.request(
            request.method, request.rel_url.path_qs, content=body or None, headers=headers
        )
        self.forwarded[f"{request.method} {request.path}"] += 1
        return reply

    def _drop(self, request: web.Request) -> web.Response:
        """Close the client's connection without a reply (the response below is never written)."""
        self.dropped += 1
        if request.transport is not None:
            request.transport.close()
        return web.Response(status=502)

    def _corrupt(self, reply: httpx2.Response) -> web.Response | None:
        """The server's generate reply, malformed; None when there is nothing to corrupt (see the docstring)."""
        if not reply.is_success:
            return None
        try:
            body = reply.json()
            finish = body["meta_info"]["finish_reason"]
        except (ValueError, KeyError, TypeError):
            return None
        if isinstance(finish, dict) and finish.get("type") == "abort":
            return None
        kind = self._rng.choice(MALFORMED_KINDS)
        if kind == "logprobs_mismatch" and not body.get("output_ids"):
            kind = "no_meta_info"  # no token to leave out
        if kind == "not_json":
            text = reply.text
            return web.Response(status=200, text=text[: len(text) // 2], content_type="application/json")
        if kind == "no_meta_info":
            return web.json_response({"text": body.get("text"), "output_ids": body.get("output_ids")})
        meta = dict(body["meta_info"])
        meta["output_token_logprobs"] = list(meta.get("output_token_logprobs") or [])[:-1]
        return web.json_response({**body, "meta_info": meta})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--upstream", required=True, help="the SGLang server, http://host:port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--error-rate", type=float, default=0.0)
    parser.add_argument("--malformed-rate", type=float, default=0.0)
    parser.add_argument("--error-status", type=int, default=503)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        faults = ProxyFaults(args.error_rate, args.malformed_rate, args.error_status, args.seed)
    except ValueError as exc:
        parser.error(str(exc))

    async def serve() -> None:
        async with FaultProxy(args.upstream, host=args.host, port=args.port, faults=faults) as proxy:
            print(f"proxying {proxy.url} -> {proxy.upstream}", flush=True)
            try:
                await asyncio.Event().wait()
            finally:
                print(json.dumps({"injected": proxy.injected, "forwarded": proxy.forwarded}), flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
