"""The session gateway as its clients see it: a live gateway in a process of its own (benchmarks/agents/gateway_host.py,
so its RSS is its alone), this process the client.

    python -m benchmarks.agents.gateway_live [--parts body tools stream] [--out FILE]

  body    oversized bodies: a `--body-mib` (32) MiB body POSTed with the session's key to Chat Completions and to
          Anthropic Messages, `--tries` times each, with a Content-Length (refused from it, before any of the body
          is read) and chunked (refused once its bytes pass the gateway's bound, 16 MiB), over a socket of this
          process's own that sends the whole body whatever the answer, as a client that does not read it would:
          the ms from the first byte sent to the answer (p50, max), its status (413) and error (the API's
          format), the gateway's RSS before and after, and its peak (VmHWM, set back to the RSS before the first).
          Targets: under 100 ms; the peak within 100 MiB of the RSS before.
  tools   `--sessions` (10,000) sessions, each one Chat Completions request offering a tool set of its own
          (`--tools-per-set` tools), then finished, `--batch` sessions at a time, over an instant backend (only
          the gateway's and the engine's cost count): the gateway's RSS at start, after every 1,000 sessions and
          at the end; the encoder's per-tool-set cache at the end (`cached_tool_sets`, at most `max_tool_sets`);
          the types of live objects whose count grew most (a leak's suspects). Target: RSS within 200 MiB of its
          start.
  stream  time to the first streamed token through the gateway over the simulated SGLang server
          (benchmarks/longtail/simserver.py, a process of its own, every reply `--tokens` tokens, one per
          `--decode-ms`):
          `--stream-requests` streamed requests (`"stream": true`) to Chat Completions and to Anthropic Messages,
          `--concurrency` at once, each in a session of its own. This process reads the server-sent events line
          by line (httpx), parsing each `data:` line as JSON; a Chat Completions chunk with `content` or
          `reasoning_content` in its delta, or a Messages `content_block_delta` with text or thinking, is the
          first token. Reported: the delay from the server's first chunk (its `first_chunk_at` stamp,
          `time.monotonic()`, one clock for the machine's processes) to that event (p50, p99, max), split at
          the backend's listener in the gateway; the time to first token and to the whole reply, from the
          request sent. Target: p99 delay within 50 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import time
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import httpx2

from benchmarks import emit
from benchmarks.agents.gateway_host import GatewayHost
from benchmarks.longtail.simserver import SimConfig, sim_server
from benchmarks.micro.stream_latency import summary

PARTS = ("body", "tools", "stream")
ENDPOINTS = {"chat": ("openai", "/chat/completions"), "messages": ("anthropic", "/v1/messages")}
TARGETS = {"body_ms": 100.0, "body_peak_growth_mib": 100.0, "tools_rss_growth_mib": 200.0, "stream_delay_p99_ms": 50.0}


# -- body --------------------------------------------------------------------------------------------------------
def raw_post(url: str, frames: list[bytes], timeout: float = 60.0) -> dict[str, Any]:
    """Send `frames` (the request's head, then its body) over a socket of its own, on after an answer until all is
    sent or the gateway closes the connection: the answer's status and body, the ms from the first byte sent to
    the answer's first, and the bytes sent by then and in all."""
    parts = urllib.parse.urlsplit(url)
    pending, current, sent, received = list(reversed(frames)), memoryview(b""), 0, bytearray()
    answered_at = sent_by_then = None
    closed = False
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.setblocking(False)
        started = time.perf_counter()
        while not closed and (pending or current or not _whole(received)):
            writing = [sock] if pending or current else []
            readable, writable, _ = select.select([sock], writing, [], timeout)
            if not readable and not writable:
                raise TimeoutError(f"no answer from {url} in {timeout} s")
            if readable:
                try:
                    data = sock.recv(1 << 16)
                except ConnectionResetError:
                    data = b""
                closed = not data
                if data and answered_at is None:
                    answered_at, sent_by_then = time.perf_counter(), sent
                received += data
            if writable and not closed:
                current = current or memoryview(pending.pop())
                try:
                    n = sock.send(current)
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    continue
                sent, current = sent + n, current[n:]
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    return {
        "status": int(head.split()[1]) if head else None, "body": json.loads(body) if body else None,
        "ms": round((answered_at - started) * 1000, 2) if answered_at else None,
        "sent_by_answer_mib": round((sent_by_then or 0) / 2**20, 2), "sent_mib": round(sent / 2**20, 2),
        "closed_by_gateway": bool(pending or current),
    }  # fmt: skip


def _whole(received: bytearray) -> bool:
    """Whether `received` holds an answer's head and its whole body (by its Content-Length)."""
    head, found, body = bytes(received).partition(b"\r\n\r\n")
    if not found:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return True


def request_frames(url: str, key: str, size: int, chunked: bool) -> list[bytes]:
    """A POST of a `size`-byte body that reads as a chat (one long user message), in pieces of 256 KiB."""
    prefix, suffix = b'{"model": "policy", "messages": [{"role": "user", "content": "', b'"}], "max_tokens": 16}'
    body = memoryview(prefix + b"a" * (size - len(prefix) - len(suffix)) + suffix)
    parts = urllib.parse.urlsplit(url)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    head = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {key}\r\nx-api-key: {key}\r\n"
            f"Content-Type: application/json\r\n{framing}\r\n\r\n").encode()  # fmt: skip
    pieces = [body[at : at + (1 << 18)] for at in range(0, size, 1 << 18)]
    if not chunked:
        return [head, *map(bytes, pieces)]
    return [head, *(b"%x\r\n" % len(p) + p + b"\r\n" for p in pieces), b"0\r\n\r\n"]


def in_api_format(api: str, body: Any) -> bool:
    """Whether a refusal's body is the API's error for a body too large."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return False
    if api == "messages":
        return body.get("type") == "error" and body["error"].get("type") == "request_too_large"
    return body["error"].get("code") == "request_too_large" and isinstance(body["error"].get("message"), str)


def oversized(args: argparse.Namespace) -> dict[str, Any]:
    size, limit = args.body_mib << 20, (args.limit_mib << 20) if args.limit_mib else None
    with GatewayHost(max_body_bytes=limit) as host:
        session = host.ask("open", n=1)["sessions"][0]
        before = host.ask("reset_peak")
        runs: dict[str, list[dict[str, Any]]] = {}
        for framing in ("content_length", "chunked"):
            for api, (base, path) in ENDPOINTS.items():
                frames = request_frames(session[base] + path, session["key"], size, framing == "chunked")
                tries = [raw_post(session[base] + path, frames) for _ in range(args.tries)]
                runs[f"{framing}:{api}"] = tries
        after = host.ask("stats")
    every = [t for tries in runs.values() for t in tries]
    report = {
        "body_mib": args.body_mib, "tries": args.tries, "statuses": Counter(str(t["status"]) for t in every),
        "in_api_format": all(in_api_format(k.split(":")[1], t["body"]) for k, ts in runs.items() for t in ts),
        "ms_to_refusal": {key: {"p50": summary([t["ms"] for t in ts])["p50"], "max": max(t["ms"] for t in ts)}
                          for key, ts in runs.items()},
        "sent_by_refusal_mib": {key: max(t["sent_by_answer_mib"] for t in ts) for key, ts in runs.items()},
        "closed_by_gateway": sum(t["closed_by_gateway"] for t in every),
        "rss_before_mib": before["rss_mib"], "rss_after_mib": after["rss_mib"], "peak_rss_mib": after["peak_rss_mib"],
        "peak_growth_mib": round(after["peak_rss_mib"] - before["rss_mib"], 1), "refused": after["counts"],
    }  # fmt: skip
    report["meets_targets"] = (
        set(report["statuses"]) == {"413"} and report["in_api_format"]
        and max(t["ms"] for t in every) < TARGETS["body_ms"]
        and report["peak_growth_mib"] < TARGETS["body_peak_growth_mib"]
    )  # fmt: skip
    return report


# -- tools -------------------------------------------------------------------------------------------------------
def tool_set(number: int, size: int) -> list[dict[str, Any]]:
    """A session's own tools: `size` functions named and described for session `number`, 3 parameters each."""
    properties = {p: {"type": "string", "description": f"The {p} to use, as the agent of session {number} names it."}
                  for p in ("path", "query", "mode")}  # fmt: skip
    return [
        {"type": "function", "function": {
            "name": f"tool_{number}_{i}", "description": f"Tool {i} of session {number}: looks things up and says so.",
            "parameters": {"type": "object", "properties": properties, "required": ["path"]},
        }}
        for i in range(size)
    ]  # fmt: skip


async def many_tool_sets(args: argparse.Namespace) -> dict[str, Any]:
    with GatewayHost() as host:
        start, census = host.ask("reset_peak"), host.ask("census")["objects"]
        samples = [{"sessions": 0, "rss_mib": start["rss_mib"]}]
        statuses: Counter[str] = Counter()
        failures = done = 0
        async with httpx2.AsyncClient(timeout=600, trust_env=False) as http:

            async def one(session: dict[str, Any], number: int) -> None:
                nonlocal failures
                body = {"model": "policy", "messages": [{"role": "user", "content": f"Session {number}: go."}],
                        "tools": tool_set(number, args.tools_per_set)}  # fmt: skip
                headers = {"Authorization": f"Bearer {session['key']}"}
                reply = await http.post(session["openai"] + "/chat/completions", json=body, headers=headers)
                failures += reply.status_code != 200

            while done < args.sessions:
                opened = host.ask("open", n=min(args.batch, args.sessions - done))["sessions"]
                async with anyio.create_task_group() as tasks:
                    for i, session in enumerate(opened):
                        tasks.start_soon(one, session, done + i)
                statuses.update(host.ask("finish", ids=[s["id"] for s in opened])["statuses"])
                before, done = done, done + len(opened)
                if done // 1000 > before // 1000 or done == args.sessions:
                    samples.append({"sessions": done, "rss_mib": host.ask("stats")["rss_mib"]})
        end, grown = host.ask("stats"), host.ask("census")["objects"]
    per_1000 = [round((b["rss_mib"] - a["rss_mib"]) * 1000 / (b["sessions"] - a["sessions"]), 1)
                for a, b in zip(samples, samples[1:], strict=False)]  # fmt: skip
    growth = {kind: n - census.get(kind, 0) for kind, n in grown.items() if n > census.get(kind, 0)}
    report = {
        "sessions": args.sessions, "tools_per_set": args.tools_per_set, "failures": failures,
        "statuses": statuses, "sessions_open": end["sessions_open"],
        "rss_start_mib": start["rss_mib"], "rss_end_mib": end["rss_mib"], "peak_rss_mib": end["peak_rss_mib"],
        "rss_growth_mib": round(end["rss_mib"] - start["rss_mib"], 1), "rss_by_sessions": samples,
        "rss_growth_mib_per_1000": per_1000, "cached_tool_sets": end["cached_tool_sets"],
        "max_tool_sets": end["max_tool_sets"],
        "objects_grown": dict(sorted(growth.items(), key=lambda kv: -kv[1])[:12]),
    }  # fmt: skip
    report["meets_targets"] = (
        report["rss_growth_mib"] <= TARGETS["tools_rss_growth_mib"] and not failures and not end["sessions_open"]
    )
    return report


# -- stream ------------------------------------------------------------------------------------------------------
def has_text(api: str, event: dict[str, Any]) -> bool:
    """Whether a streamed event carries reasoning or content."""
    if api == "messages":
        delta = event.get("delta") or {}
        return event.get("type") == "content_block_delta" and bool(delta.get("text") or delta.get("thinking"))
    deltas = [choice.get("delta") or {} for choice in event.get("choices") or ()]
    return any(d.get("content") or d.get("reasoning_content") for d in deltas)


async def streamed(http: httpx2.AsyncClient, api: str, session: dict[str, Any], number: int, cap: int) -> dict:
    """One streamed request: when it was sent, when its first token came, when its stream ended."""
    base, path = ENDPOINTS[api]
    body = {"model": "policy", "stream": True, "max_tokens": cap,
            "messages": [{"role": "user", "content": f"Question {number}: what is the weather like?"}]}  # fmt: skip
    headers = {"Authorization": f"Bearer {session['key']}", "x-api-key": session["key"]}
    first, texts = None, 0
    sent = time.monotonic()
    async with http.stream("POST", session[base] + path, json=body, headers=headers) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and has_text(api, json.loads(line[6:])):
                first, texts = first or time.monotonic(), texts + 1
    return {"id": session["id"], "status": reply.status_code, "sent": sent, "first": first, "end": time.monotonic(),
            "texts": texts}  # fmt: skip


async def first_token(args: argparse.Namespace) -> dict[str, Any]:
    config = SimConfig(
        max_running=max(16, args.concurrency), decode_a=args.decode_ms / 1000, decode_b=0.0, prefill_s_per_token=0.0,
        median_tokens=float(args.tokens), sigma=0.0, max_turn_tokens=args.tokens,
    )  # fmt: skip
    report: dict[str, Any] = {"requests": args.stream_requests, "concurrency": args.concurrency,
                              "tokens": args.tokens, "decode_ms": args.decode_ms}  # fmt: skip
    with sim_server(config) as url, GatewayHost(url, max_new_tokens=args.tokens + 16) as host:
        async with httpx2.AsyncClient(timeout=600, trust_env=False) as http:
            for api in ENDPOINTS:
                report[api] = await stream_api(http, host, api, args)
    report["meets_targets"] = all(
        report[api]["first_token_delay_ms"]["p99"] <= TARGETS["stream_delay_p99_ms"] and not report[api]["no_token"]
        for api in ENDPOINTS
    )
    return report


async def stream_api(http: httpx2.AsyncClient, host: GatewayHost, api: str, args: argparse.Namespace) -> dict:
    """`--stream-requests` streamed requests to one API, `--concurrency` at once, each in a session of its own."""
    opened = host.ask("open", n=args.stream_requests)["sessions"]
    runs: list[dict[str, Any]] = []
    limit = anyio.Semaphore(args.concurrency)

    async def run(session: dict[str, Any], number: int) -> None:
        async with limit:
            runs.append(await streamed(http, api, session, number, args.tokens + 16))

    async with anyio.create_task_group() as tasks:
        for number, session in enumerate(opened):
            tasks.start_soon(run, session, number)
    finished = host.ask("finish", ids=[s["id"] for s in opened])
    stamps = finished["stamps"]  # each session's one turn
    timed = [(r, stamps[r["id"]][0]) for r in runs if r["first"] is not None and stamps[r["id"]]]
    ms = lambda values: summary([v * 1000 for v in values])  # noqa: E731
    return {
        "statuses": Counter(str(r["status"]) for r in runs), "turns": finished["statuses"],
        "no_token": len(runs) - len(timed),
        "text_events_per_request": {"min": min(r["texts"] for r in runs), **summary([r["texts"] for r in runs])},
        "first_token_delay_ms": ms([r["first"] - s["first_chunk_at"] for r, s in timed]),
        "server_to_listener_ms": ms([s["listener_at"] - s["first_chunk_at"] for r, s in timed]),
        "listener_to_client_ms": ms([r["first"] - s["listener_at"] for r, s in timed]),
        "client_ttft_ms": ms([r["first"] - r["sent"] for r, s in timed]),
        "client_e2e_ms": ms([r["end"] - r["sent"] for r, s in timed]),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.agents.gateway_live", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--out", help="write the JSON report here too")
    parser.add_argument("--body-mib", type=int, default=32, help="body: the oversized body's size")
    parser.add_argument("--limit-mib", type=int, help="body: the gateway's bound (default: its own, 16 MiB)")
    parser.add_argument("--tries", type=int, default=5, help="body: posts of each framing to each API")
    parser.add_argument("--sessions", type=int, default=10_000, help="tools: sessions, each with a tool set of its own")
    parser.add_argument("--batch", type=int, default=100, help="tools: sessions open at once")
    parser.add_argument("--tools-per-set", type=int, default=8, help="tools: tools in each session's set")
    parser.add_argument("--stream-requests", type=int, default=64, help="stream: streamed requests per API")
    parser.add_argument("--concurrency", type=int, default=8, help="stream: requests in flight at once")
    parser.add_argument("--tokens", type=int, default=200, help="stream: tokens in each reply")
    parser.add_argument("--decode-ms", type=float, default=5.0, help="stream: the simulated server's step, ms")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "benchmark": "gateway_live", "targets": TARGETS,
        "machine": {"cpus": os.cpu_count(), "load_average_1m_5m_15m": [round(x, 2) for x in os.getloadavg()]},
    }  # fmt: skip
    if "body" in args.parts:
        report["body"] = oversized(args)
    if "tools" in args.parts:
        report["tools"] = anyio.run(many_tool_sets, args)
    if "stream" in args.parts:
        report["stream"] = anyio.run(first_token, args)
    report["meets_targets"] = all(report[part]["meets_targets"] for part in args.parts)
    emit(report, Path(args.out) if args.out else None)
    return report


if __name__ == "__main__":
    main()
