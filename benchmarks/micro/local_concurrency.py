"""One request alone versus many at once on the local backend: does batching pay?

    python -m benchmarks.micro local_concurrency [--out FILE] [--model tiny-qwen2] [--concurrency 32]

Every request has a prompt of `--prompt-tokens` random token ids and generates exactly
`--max-new-tokens` tokens (ignore_eos). After a warm-up of each shape, both shapes are timed
`--repeats` times, alternating; the report is the median seconds of each and their ratio, as JSON
on stdout (and in FILE). The target is a ratio under 3: 32 concurrent requests in less than three
times the time of one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import anyio
import torch

from benchmarks import emit
from engine.backends.base import SamplingParams
from engine.backends.local import LocalBackend

TARGET_RATIO = 3.0


async def run_requests(backend: LocalBackend, prompts: list[list[int]], params: SamplingParams) -> float:
    """Seconds until every prompt has its result, all submitted at once."""
    lengths: list[int] = []

    async def one(prompt: list[int]) -> None:
        lengths.append(len((await backend.generate(prompt, params)).token_ids))

    start = time.perf_counter()
    async with anyio.create_task_group() as task_group:
        for prompt in prompts:
            task_group.start_soon(one, prompt)
    seconds = time.perf_counter() - start
    assert lengths == [params.max_new_tokens] * len(prompts), lengths
    return seconds


async def measure(args: argparse.Namespace) -> dict:
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 150_000, (args.concurrency, args.prompt_tokens), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, ignore_eos=True)
    single: list[float] = []
    concurrent: list[float] = []
    async with LocalBackend.from_name(args.model) as backend:
        await run_requests(backend, prompts[:1], params)  # warm-up
        await run_requests(backend, prompts, params)
        for _ in range(args.repeats):
            single.append(await run_requests(backend, prompts[:1], params))
            concurrent.append(await run_requests(backend, prompts, params))
        stats = backend.statistics()
    ratio = statistics.median(concurrent) / statistics.median(single)
    return {
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": round(os.getloadavg()[0], 2),  # other work on the machine skews the timings
        "single_seconds": round(statistics.median(single), 4),
        "concurrent_seconds": round(statistics.median(concurrent), 4),
        "ratio": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio < TARGET_RATIO,
        "single_runs": [round(s, 4) for s in single],
        "concurrent_runs": [round(s, 4) for s in concurrent],
        "num_batches": stats.num_batches,
        "largest_batch": stats.largest_batch,
        "num_steps": stats.num_steps,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    parser.add_argument("--model", default="tiny-qwen2")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    report = anyio.run(measure, args)
    emit(report, args.out)
    return report


if __name__ == "__main__":
    main()
