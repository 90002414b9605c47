"""How late a streamed token reaches its listener: from the simulated SGLang server sending a generation's first
chunk to the SGLangBackend's listener getting its tokens.

    python -m benchmarks.micro stream_latency --out FILE [--requests 128] [--concurrency 16] [--tokens 200]
        [--decode-ms 5]

One simulated server (benchmarks/longtail/simserver.py, its own process, continuous batching, every turn `--tokens`
long, a step of `--decode-ms`) streams every reply; this process sends `--requests` generations through SGLangBackend,
`--concurrency` at once, each with a listener. The server stamps each chunk with the moment it sent the first one
(`first_chunk_at`, `time.monotonic()`: one clock for every process of the machine); the listener notes when its
first tokens came. For cumulative chunks (SGLang's default) and incremental ones (`--incremental-streaming-output`),
each on a fresh server:

- `first_token_delay_ms`: listener's first call less the server's first chunk (p50, p99, max): what streaming adds
  to the model's time to first token;
- `client_ttft_ms` and `client_e2e_ms`: from the request sent to the listener's first call, and to the result (an
  unstreamed client waits the latter for its first token);
- `listener_calls_per_request`: chunks that reached the listener (one per server step, fewer where they queued);
- `client_cpu_us_per_chunk`: this process's CPU (the backend reading the stream, all of it) per chunk: with
  cumulative chunks it would grow with the turn's length were each chunk parsed whole (`--tokens 4000` shows it).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import anyio

from benchmarks import emit
from benchmarks.longtail.model import IM_END, IM_START
from benchmarks.longtail.simserver import SimConfig, sim_server
from engine.backends.base import SamplingParams
from engine.backends.sglang import SGLangBackend

MODES = ("cumulative", "incremental")


def prompt(i: int) -> list[int]:
    """A chat-shaped prompt of its own (a fresh turn of the simulated model each)."""
    return [IM_START, 872, 198, 1000 + i, 2000 + i, IM_END, 198, IM_START, 77091, 198]


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": round(at(0.5), 3), "p99": round(at(0.99), 3), "max": round(ordered[-1], 3)}


async def one(backend: SGLangBackend, i: int, params: SamplingParams) -> dict[str, float]:
    """One streamed generation: when it was sent, when its first tokens came, when it ended, and its chunks."""
    first: list[float] = []
    calls = 0

    def listener(token_ids: list[int]) -> None:
        nonlocal calls
        calls += 1
        if not first:
            first.append(time.monotonic())

    sent = time.monotonic()
    result = await backend.generate(prompt(i), params, on_tokens=listener)
    ended = time.monotonic()
    return {
        "delay": first[0] - result.meta["first_chunk_at"], "ttft": first[0] - sent, "e2e": ended - sent,
        "calls": calls, "tokens": len(result.token_ids),
    }  # fmt: skip


async def measure_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    config = SimConfig(
        max_running=max(args.concurrency, 1), decode_a=args.decode_ms / 1000, decode_b=0.0, prefill_s_per_token=0.0,
        median_tokens=float(args.tokens), sigma=0.0, max_turn_tokens=args.tokens,
        incremental_streaming_output=mode == "incremental",
    )  # fmt: skip
    params = SamplingParams(max_new_tokens=args.tokens + 16, stop_token_ids=(IM_END,))
    runs: list[dict[str, float]] = []
    limit = anyio.Semaphore(args.concurrency)

    async def run(i: int) -> None:
        async with limit:
            runs.append(await one(backend, i, params))

    with sim_server(config) as url:
        async with SGLangBackend(url, timeout=60) as backend:
            await backend.wait_until_healthy(30, poll_interval=0.05)
            cpu = time.process_time()
            async with anyio.create_task_group() as tasks:
                for i in range(args.requests):
                    tasks.start_soon(run, i)
            cpu = time.process_time() - cpu
    return {
        "client_cpu_us_per_chunk": round(cpu / sum(r["calls"] for r in runs) * 1e6, 1),
        "first_token_delay_ms": summary([r["delay"] * 1000 for r in runs]),
        "client_ttft_ms": summary([r["ttft"] * 1000 for r in runs]),
        "client_e2e_ms": summary([r["e2e"] * 1000 for r in runs]),
        "listener_calls_per_request": summary([r["calls"] for r in runs]),
        "tokens_per_request": summary([r["tokens"] for r in runs]),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    modes = {mode: await measure_mode(mode, args) for mode in args.modes}
    return {
        "benchmark": "stream_latency",
        "machine": {"cpus": os.cpu_count(), "load_average_1m_5m_15m": [round(x, 2) for x in os.getloadavg()]},
        "workload": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "tokens": args.tokens,
            "decode_ms": args.decode_ms,
        },  # fmt: skip
        "modes": modes,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.micro stream_latency", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--out", help="write the JSON report here too")
    parser.add_argument("--requests", type=int, default=128, help="streamed generations per mode")
    parser.add_argument("--concurrency", type=int, default=16, help="generations in flight at once")
    parser.add_argument("--tokens", type=int, default=200, help="tokens in each generation")
    parser.add_argument("--decode-ms", type=float, default=5.0, help="the simulated server's step, ms")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args(argv)
    report = anyio.run(measure, args)
    emit(report, Path(args.out) if args.out else None)
    return report


if __name__ == "__main__":
    main()
