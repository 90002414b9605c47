"""CPU per turn against context length: what one turn costs the engine as a trajectory's history grows.

    python -m benchmarks.scale.context_cost [--out FILE] [--contexts 1024 4096 16384 32768 65536] [--images 0 4]
        [--trajectories 16] [--turns 17] [--repeats 3]

Each trajectory's prompt holds `context` tokens of text (and `images` pictures of 448 x 448, with the tiny
Qwen2.5-VL processor). The whole engine runs: RolloutEngine and its scheduler, `SGLangBackend` building each
request body and reading each reply, the real tokenizer encoding each observation. Every turn the model writes 32
tokens and the env answers at once with a 40-token tool message. The server is an in-process double
(httpx2.MockTransport: no network, no server process) that answers without decoding the body, so what is counted
is the engine's own work: it counts the prompt's tokens from the body's bytes and replies with bytes built once.

CPU per turn is this process's CPU time (every thread) from the moment every trajectory has sent its first request
(every prompt encoded, the engine started) to the end of the run, over the turns generated in that time. Each
figure is the median of `repeats` runs. Reported per context and image count: `cpu_ms_per_turn`,
`context_tokens` (the prompt's, images expanded), `request_bytes` (a turn's body), and `ratio_to_smallest`, each
figure over that of the smallest context with the same images.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import anyio
import httpx2
import numpy as np
import orjson

from benchmarks import emit
from benchmarks.micro.payloads import photo
from engine.backends.base import SamplingParams
from engine.backends.sglang import SGLangBackend
from engine.config import EngineConfig
from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine
from engine.envs.base import AsyncInteractionEnv, EnvRunner
from engine.turn import TurnLimits

GENERATED = 32  # tokens the model writes per turn
OBSERVATION = " ".join(["the tool ran and printed"] * 8)  # about 40 tokens


class InstantEnv(AsyncInteractionEnv):
    """Answers every turn at once with the same tool message; never done (the turn limit ends it)."""

    def reset(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return {}, {}

    async def astep(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        return {"role": "tool", "content": OBSERVATION}, False, {}

    def format_observation(self, observation: dict[str, Any]) -> dict[str, Any]:
        return observation


class CountingSGLang:
    """/model_info, and /generate answered with GENERATED tokens (the last the end-of-turn token), the prompt's
    length counted from the body's bytes (commas in its input_ids), the prompt's images expanded."""

    def __init__(self, eot: int, images: int, pads_per_image: int, prompt_sent: int, trajectories: int):
        self.expanded = images * (pads_per_image - 1)  # the prompt's images, each sent as one pad
        self.prompt_sent, self.first_left = prompt_sent, trajectories  # a first request sends the prompt alone
        self.cpu_at_mark: float | None = None  # process CPU once every trajectory sent its first request
        self.after_mark = 0  # requests since
        ids = [*np.random.default_rng(0).integers(1000, 20000, GENERATED - 1).tolist(), eot]
        self.reply_head = orjson.dumps({"text": "", "output_ids": ids})[:-1]
        self.logprobs = [[-0.5, token, None] for token in ids]
        self.eot = eot
        self.transport = httpx2.MockTransport(self.handle)

    async def handle(self, request: httpx2.Request) -> httpx2.Response:
        await anyio.sleep(0)  # the reply comes back over the network: other turns run meanwhile
        if request.url.path == "/model_info":
            return httpx2.Response(200, json={"weight_version": "0"})
        if request.url.path != "/generate":
            return httpx2.Response(404, json={"detail": "Not Found"})
        body = request.content
        sent = body[: body.index(b"]")].count(b",") + 1
        if self.cpu_at_mark is not None:
            self.after_mark += 1
        elif sent == self.prompt_sent:
            self.first_left -= 1
            if self.first_left == 0:
                self.cpu_at_mark = time.process_time()
        meta = {
            "finish_reason": {"type": "stop", "matched": self.eot},
            "prompt_tokens": sent + self.expanded,
            "cached_tokens": 0,
            "weight_version": "0",
            "output_token_logprobs": self.logprobs,
        }
        content = self.reply_head + b',"meta_info":' + orjson.dumps(meta) + b"}"
        return httpx2.Response(200, content=content, headers={"content-type": "application/json"})


def prompt_of(context: int, images: int) -> list[dict[str, Any]]:
    text = "Read this and answer:" + " hello" * context
    parts: list[dict[str, Any]] = [{"type": "image", "image": photo(448, seed)} for seed in range(images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}] if images else text}]


async def run(encoder: ChatEncoder, rows: list[dict[str, Any]], turns: int, images: int, pads: int, sent: int) -> float:
    """Process CPU seconds per turn of every row's trajectory to `turns` turns, from the moment every trajectory sent
    its first request (of `sent` ids); its prompt holds `images` pictures of `pads` tokens each."""
    mock = CountingSGLang(encoder.stop_token_ids[0], images, pads, sent, len(rows))
    config = EngineConfig(
        n_samples_per_prompt=1, max_inflight=len(rows), max_generating=len(rows), max_env_steps=len(rows),
        limits=TurnLimits(max_turns=turns), sampling=SamplingParams(max_new_tokens=GENERATED),
    )  # fmt: skip
    backend = SGLangBackend("http://sglang.test", image_token_id=encoder.image_token_id, transport=mock.transport)
    async with backend, RolloutEngine(
        backend=backend, encoder=encoder, env_factory=lambda sample: EnvRunner(InstantEnv()), source=rows,
        config=config,
    ) as engine:  # fmt: skip
        groups = await engine.rollout(len(rows))
    cpu = time.process_time()
    failed = [t.errors for g in groups for t in g.trajectories if t.status.value == "failed"]
    if failed:
        raise RuntimeError(f"trajectories failed: {failed[0]}")
    assert mock.cpu_at_mark is not None and mock.after_mark > 0, "no turn after every first request"
    return (cpu - mock.cpu_at_mark) / mock.after_mark


def measure(encoder: ChatEncoder, context: int, images: int, args: argparse.Namespace) -> dict[str, Any]:
    rows = [{"prompt": prompt_of(context, images), "label": ""} for _ in range(args.trajectories)]
    encoded = encoder.encode_prompt(rows[0]["prompt"])
    ids = list(encoded.token_ids)
    pads = ids.count(encoder.image_token_id) // images if images else 1
    sent = len(ids) - images * (pads - 1)
    per_turn = [anyio.run(run, encoder, rows, args.turns, images, pads, sent) for _ in range(args.repeats)]
    body = 7 * sent + sum(len(p) for p in encoded.image_data)
    return {
        "context": context, "images": images, "context_tokens": len(ids), "request_bytes": body,
        "cpu_ms_per_turn": round(1e3 * statistics.median(per_turn), 3),
        "cpu_ms_per_turn_all": [round(1e3 * x, 3) for x in per_turn],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768, 65536])
    parser.add_argument("--images", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--turns", type=int, default=17)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.turns < 2:
        parser.error("--turns must be at least 2 (the first turns are not counted)")
    from engine.models import load_processor, load_tokenizer

    text = ChatEncoder(load_tokenizer("qwen2.5"))
    processor = load_processor("qwen2.5-vl")
    vision = ChatEncoder(processor.tokenizer, processor=processor)
    rows = []
    for images in args.images:
        encoder = vision if images else text
        for context in args.contexts:
            rows.append(measure(encoder, context, images, args))
            print(rows[-1], file=sys.stderr)
    for row in rows:
        smallest = min((r for r in rows if r["images"] == row["images"]), key=lambda r: r["context"])
        row["ratio_to_smallest"] = round(row["cpu_ms_per_turn"] / smallest["cpu_ms_per_turn"], 2)
    emit({"benchmark": "context_cost", "config": vars(args) | {"out": None}, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
