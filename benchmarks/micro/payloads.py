"""Event-loop time per turn of a vision trajectory: encoding the observation and sending the SGLang request.

    python -m benchmarks.micro payloads [--out FILE] [--turns N] [--image-size PX] [--repeats R]
    git archive HEAD | tar -x -C /tmp/turnstile-head        # the code before, to compare with
    python -m benchmarks.micro payloads --tree /tmp/turnstile-head --out before.json

One trajectory of N turns with the tiny Qwen2.5-VL processor: the prompt holds one image, and every turn
the model answers and the env sends a photo-like PNG-able image (noise over a gradient, PX x PX) with a
sentence. A turn is `SGLangBackend.generate` with every image so far, through an httpx2.MockTransport that
answers after one yield to the loop (no network, no server: what is left is the client's own work), then
encoding the env's observation: mode "sync" calls `encode_observation` (as engine/turn.py does today),
mode "async" `aencode_observation` (where the code has it). Per turn:

    loop_cpu_ms   CPU time of the event-loop thread (time.thread_time), measured with nothing else running
    wall_ms       the turn's wall time
    lag_*_ms      how late a 1 ms timer on the same loop fires while the turns run (p50, p99, max): the
                  stalls the rest of the engine would see, including a worker thread's GIL-held parts

Each figure is the median over R repeats (fresh images each, so no cache helps across repeats). Pieces are
timed alone too (fastest of 15): the body as httpx2's `json=` builds it (the stdlib encoder) and as
`generate_body` does (payloads already serialised, as on every turn but an image's first), a PNG payload,
and a thread hop's loop CPU. `--tree` imports the engine from another source tree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from functools import partial
from typing import Any

import numpy as np

from benchmarks import emit

EOT = 151645  # <|im_end|>


def photo(size: int, seed: int):
    """A photo-like image: PNG compresses it about as badly as a real photo."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.random((size, size, 3)) * 40 + np.linspace(0, 200, size)[None, :, None]
    return Image.fromarray(pixels.astype(np.uint8), "RGB")


def image_message(image, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}


class MockSGLang:
    """Answers /workers with 404 (a server, not a router) and /generate with one end-of-turn token, after
    yielding to the loop once as a network round trip would."""

    def __init__(self):
        import httpx2

        self.prompt_tokens = 0
        self.transport = httpx2.MockTransport(self.handle)

    async def handle(self, request):
        import anyio
        import httpx2

        await anyio.sleep(0)  # a reply comes back over the network: the loop runs other tasks meanwhile
        if request.url.path != "/generate":
            return httpx2.Response(404, json={"detail": "Not Found"})
        meta = {
            "finish_reason": {"type": "stop", "matched": EOT},
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": 0,
            "weight_version": "0",
            "output_token_logprobs": [[-0.1, EOT, None]],
        }
        return httpx2.Response(200, json={"text": "", "output_ids": [EOT], "meta_info": meta})


def backend_for(mock: MockSGLang, image_token_id: int):
    """An SGLangBackend over the mock transport (given to it, or swapped in where the code predates the option)."""
    import inspect

    import httpx2

    from engine.backends.sglang import SGLangBackend

    if "transport" in inspect.signature(SGLangBackend).parameters:
        return SGLangBackend("http://sglang.test", image_token_id=image_token_id, transport=mock.transport)
    backend = SGLangBackend("http://sglang.test", image_token_id=image_token_id)
    backend._client = backend._server.client = httpx2.AsyncClient(transport=mock.transport)
    return backend


async def run_trajectory(encoder, mode: str, turns: int, size: int, seed: int, lag: bool) -> dict[str, Any]:
    import anyio

    from engine.backends.base import SamplingParams

    mock = MockSGLang()
    params = SamplingParams(max_new_tokens=64, stop_token_ids=encoder.stop_token_ids)
    prompt = encoder.encode_prompt([image_message(photo(size, seed), "What is drawn here? Look closely.")])
    tokens, image_data = list(prompt.token_ids), list(prompt.image_data)
    messages = [
        image_message(photo(size, seed + 1 + t), f"Not quite: look again at picture {t}.") for t in range(turns)
    ]
    lates: list[float] = []
    stop = anyio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            await anyio.sleep(0.001)
            lates.append(time.perf_counter() - started - 0.001)

    cpu, wall = [], []
    async with backend_for(mock, encoder.image_token_id) as backend, anyio.create_task_group() as tg:
        if lag:
            tg.start_soon(ticker)
            await anyio.sleep(0.02)
            lates.clear()
        for message in messages:
            cpu0, wall0 = time.thread_time(), time.perf_counter()
            mock.prompt_tokens = len(tokens)
            result = await backend.generate(tokens, params, image_data)
            tokens += result.token_ids
            if mode == "async":
                encoded = await encoder.aencode_observation(message)
            else:
                encoded = encoder.encode_observation(message)
            tokens += encoded.token_ids
            image_data += encoded.image_data
            cpu.append(time.thread_time() - cpu0)
            wall.append(time.perf_counter() - wall0)
        stop.set()
    out = {"loop_cpu_ms": 1e3 * statistics.mean(cpu), "wall_ms": 1e3 * statistics.mean(wall)}
    if lag:
        lates.sort()
        out.update(
            lag_p50_ms=1e3 * lates[len(lates) // 2],
            lag_p99_ms=1e3 * lates[int(0.99 * (len(lates) - 1))],
            lag_max_ms=1e3 * lates[-1],
        )
    out["final_tokens"], out["final_images"] = len(tokens), len(image_data)
    out["request_bytes"] = 7 * len(tokens) + sum(len(p) for p in image_data)
    return out


def trajectory_figures(encoder, mode: str, turns: int, size: int, repeats: int) -> dict[str, Any]:
    import anyio

    runs = []
    for r in range(repeats):
        seed = 1000 * (r + 1) + (0 if mode == "sync" else 500)
        timing = anyio.run(run_trajectory, encoder, mode, turns, size, seed, False)
        lagged = anyio.run(run_trajectory, encoder, mode, turns, size, seed + 100, True)  # the ticker costs loop CPU
        timing.update({k: v for k, v in lagged.items() if k.startswith("lag_")})
        runs.append(timing)
    keys = [k for k in runs[0] if k.endswith("_ms")]
    figures = {k: round(statistics.median(run[k] for run in runs), 3) for k in keys}
    figures.update({k: runs[0][k] for k in ("final_tokens", "final_images", "request_bytes")})
    return figures


def best_ms(fn, n: int = 15) -> float:
    fn()
    times = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return round(1e3 * min(times), 3)


def pieces(size: int) -> dict[str, Any]:
    """The parts of a turn, timed alone."""
    import anyio

    from engine.multimodal import image_payload

    payload = image_payload(photo(size, 1))
    params = {"max_new_tokens": 512, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "skip_special_tokens": True}
    out: dict[str, Any] = {
        "payload_chars": len(payload),
        "png_payload_ms": best_ms(lambda: image_payload(photo(size, 1)), 5),
    }
    try:
        from engine.backends.sglang_format import JSONStrings, generate_body
    except ImportError:
        generate_body = None
    for images, ids in ((0, 4000), (0, 32000), (4, 4000), (16, 4000), (16, 32000)):
        input_ids = np.random.default_rng(0).integers(0, 150_000, ids).tolist()
        image_data = [payload[:-4] + f"{i:04d}" for i in range(images)]
        body = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True, "rid": "r"}
        if images:
            body["image_data"] = image_data
        row: dict[str, Any] = {
            "httpx_json_ms": best_ms(
                lambda body=body: json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
            )
        }
        if generate_body is not None:
            strings = JSONStrings()  # filled by best_ms's first call: as on every turn after an image's first
            row["generate_body_ms"] = best_ms(
                partial(generate_body, input_ids, params, "r", image_data if images else None, strings=strings)
            )
        out[f"body_{images}img_{ids // 1000}k_ids"] = row

    async def hops() -> float:
        started = time.thread_time()
        for _ in range(200):
            await anyio.to_thread.run_sync(lambda: None)
        return round(1e3 * (time.thread_time() - started) / 200, 4)

    out["thread_hop_loop_cpu_ms"] = anyio.run(hops)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON report here")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tree", help="import the engine from this source tree (e.g. an export of HEAD)")
    args = parser.parse_args()
    if args.tree:
        sys.path.insert(0, args.tree)
    import engine
    from engine.encoding import ChatEncoder
    from engine.models import load_processor

    processor = load_processor("qwen2.5-vl")
    encoder = ChatEncoder(processor.tokenizer, processor=processor)
    modes = ["sync", "async"] if hasattr(encoder, "aencode_observation") else ["sync"]
    report = {
        "benchmark": "payloads",
        "engine_from": str(engine.__path__[0]),
        "turns": args.turns,
        "image": f"{args.image_size}x{args.image_size} photo-like, one per turn and one in the prompt",
        "repeats": args.repeats,
        "cpus": len(__import__("os").sched_getaffinity(0)),
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
        "threads_at_start": threading.active_count(),
        "per_turn": {
            mode: trajectory_figures(encoder, mode, args.turns, args.image_size, args.repeats) for mode in modes
        },
        "pieces": pieces(args.image_size),
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
