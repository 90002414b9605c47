"""Bytes per stored token: Trajectory's arrays against the lists of Python numbers they replace.

    python -m benchmarks.micro trajectory_memory [--out FILE] [--tokens N] [--turns T]

Builds one trajectory of N tokens over T turns (half generated, half observation) through the
Trajectory API, and measures with tracemalloc what its token, log-prob and loss-mask storage
allocates; then the same data held as Python lists (ints, floats), as slime's Sample holds it.
"""

from __future__ import annotations

import argparse
import random
import tracemalloc

from benchmarks import emit
from engine.trajectory import Trajectory


def payload(num_tokens: int, num_turns: int, seed: int = 0):
    rng = random.Random(seed)
    prompt = [rng.randrange(151_000) for _ in range(num_tokens // 10)]
    per_turn = (num_tokens - len(prompt)) // num_turns
    turns = []
    for _ in range(num_turns):
        generated = [rng.randrange(151_000) for _ in range(per_turn // 2)]
        turns.append(
            (
                generated,
                [-rng.random() * 5 for _ in generated],
                [rng.randrange(151_000) for _ in range(per_turn - per_turn // 2)],
            )
        )
    return prompt, turns


def build_arrays(prompt, turns) -> Trajectory:
    trajectory = Trajectory(prompt=[])
    trajectory.set_prompt(prompt)
    for generated, logprobs, observation in turns:
        trajectory.append_generation(generated, logprobs)
        trajectory.append_observation(observation)
    return trajectory


def build_lists(prompt, turns) -> dict:
    tokens, logprobs, mask = list(prompt), [], []
    for generated, lps, observation in turns:
        tokens += generated
        logprobs += [float(x) for x in lps]
        mask += [1] * len(generated)
        tokens += observation
        logprobs += [0.0] * len(observation)
        mask += [0] * len(observation)
    # fresh int objects, as tokens decoded from a JSON reply are (ints above 256 are never shared)
    return {"tokens": [int(str(t)) for t in tokens], "logprobs": logprobs, "loss_mask": mask}


def allocated(build, *args) -> tuple[object, int]:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    obj = build(*args)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return obj, after - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON report here")
    parser.add_argument("--tokens", type=int, default=32_768)
    parser.add_argument("--turns", type=int, default=16)
    args = parser.parse_args()
    prompt, turns = payload(args.tokens, args.turns)
    trajectory, array_bytes = allocated(build_arrays, prompt, turns)
    _, list_bytes = allocated(build_lists, prompt, turns)
    n = len(trajectory.tokens)
    report = {
        "benchmark": "trajectory_memory",
        "tokens": n,
        "response_tokens": trajectory.response_length,
        "array_payload_bytes_per_token": round(trajectory.nbytes() / n, 3),
        "array_allocated_bytes_per_token": round(array_bytes / n, 3),
        "python_lists_allocated_bytes_per_token": round(list_bytes / n, 3),
        "saving_factor": round(list_bytes / array_bytes, 1),
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
