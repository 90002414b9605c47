"""The simulated server's parts (see simserver.py): its deterministic "model", prefix cache, requests and
measurements.

A model turn starts after the last `<|im_start|>` of the input and the two tokens that follow it
(`assistant`, `\\n`). Its total length L (lognormal, capped) and its tokens depend only on the input
up to that start, so an aborted turn resumed later (its tokens so far appended to the input) continues
the same stream to the same L. The turn ends with `<|im_end|>`.

Identical prefixes (the n samples of one prompt) get distinct variants 0, 1, 2, ... in the order they
arrive, as n samples at temperature 1 would differ. A request aborted before its first token gives its
variant back, and a resumed turn finds its variant by its first token; so a group of n samples always
draws variants 0..n-1, whatever order a policy sends them in.

    model = TurnModel(seed=0, median=80, sigma=0.99, max_turn_tokens=1000)
    stream, offset = model.open_turn(input_ids)     # stream.tokens[offset:] is what the request generates
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import math
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

IM_START, IM_END = 151644, 151645
FIRST_ORDINARY_ID, LAST_ORDINARY_ID = 1000, 150000  # generated ids are never special tokens
HEADER_TOKENS = 3  # <|im_start|> assistant \n


def turn_start(input_ids: Sequence[int]) -> int:
    """Where the model's current turn starts: after the last `<|im_start|>` and its role header."""
    try:
        last = len(input_ids) - 1 - input_ids[::-1].index(IM_START)
    except ValueError:
        return len(input_ids)
    return min(last + HEADER_TOKENS, len(input_ids))


@dataclass(frozen=True, slots=True, eq=False)
class Stream:
    """One turn's full output: `tokens` (ending with IM_END) and their log-probs."""

    key: int
    variant: int
    tokens: np.ndarray
    logprobs: np.ndarray


class TurnModel:
    def __init__(self, seed: int, median: float, sigma: float, max_turn_tokens: int):
        self.seed, self.median, self.sigma, self.max_turn_tokens = seed, median, sigma, max_turn_tokens
        self._handed: dict[int, int] = {}  # prefix key -> variants handed out
        self._released: dict[int, list[int]] = {}  # prefix key -> variants given back (a heap)
        self._by_first: dict[tuple[int, int], int] = {}  # (prefix key, first token) -> variant

    def key(self, prefix: Sequence[int]) -> int:
        data = array("q", [self.seed]).tobytes() + array("i", prefix).tobytes()
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

    def stream(self, key: int, variant: int) -> Stream:
        rng = np.random.default_rng([self.seed, key, variant])
        length = round(rng.lognormal(math.log(self.median), self.sigma))
        length = min(max(2, length), self.max_turn_tokens)
        tokens = rng.integers(FIRST_ORDINARY_ID, LAST_ORDINARY_ID, size=length)
        tokens[-1] = IM_END
        return Stream(key, variant, tokens, -rng.uniform(0.005, 3.0, size=length))

    def open_turn(self, input_ids: Sequence[int]) -> tuple[Stream, int]:
        """The stream this request continues, and how many of its tokens the input already holds."""
        start = turn_start(input_ids)
        key = self.key(input_ids[:start])
        offset = len(input_ids) - start
        if offset:
            return self.stream(key, self._by_first.get((key, input_ids[start]), 0)), offset
        if self._released.get(key):
            variant = heapq.heappop(self._released[key])
        else:
            variant = self._handed.get(key, 0)
            self._handed[key] = variant + 1
        stream = self.stream(key, variant)
        self._by_first[(key, int(stream.tokens[0]))] = variant
        return stream, 0

    def release(self, stream: Stream) -> None:
        """A request of this stream was aborted before its first token: the next identical prefix gets it."""
        heapq.heappush(self._released.setdefault(stream.key, []), stream.variant)


class PrefixCache:
    """Blocks of 16 tokens, each named by a hash chained over the blocks before it; LRU beyond capacity."""

    BLOCK = 16

    def __init__(self, capacity_tokens: int):
        self.capacity = max(1, capacity_tokens // self.BLOCK)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def _chain(self, ids: Sequence[int]) -> Iterator[int]:
        h = 0
        for i in range(0, len(ids) - self.BLOCK + 1, self.BLOCK):
            h = hash((h, *ids[i : i + self.BLOCK]))
            yield h

    def match(self, ids: Sequence[int]) -> int:
        """How many leading tokens of `ids` are cached."""
        n = 0
        for h in self._chain(ids):
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            n += 1
        return n * self.BLOCK

    def insert(self, ids: Sequence[int]) -> None:
        for h in self._chain(ids):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


@dataclass(slots=True)
class Stats:
    """Server-side measurements since `started`; `running_seconds` is the time-integral of running requests."""

    started: float = field(default_factory=time.monotonic)
    running_seconds: float = 0.0
    busy_seconds: float = 0.0
    num_steps: int = 0
    num_requests: int = 0
    num_aborted: int = 0
    generated_tokens: int = 0
    aborted_tokens: int = 0  # generated, then returned by an abort
    prefill_tokens: int = 0
    cached_tokens: int = 0

    def snapshot(self, max_running: int) -> dict[str, Any]:
        wall = time.monotonic() - self.started
        out = {k: v for k, v in asdict(self).items() if k != "started"}
        out.update(
            wall_seconds=wall,
            max_running=max_running,
            utilization=self.running_seconds / (max_running * wall) if wall > 0 else 0.0,
            busy_fraction=self.busy_seconds / wall if wall > 0 else 0.0,
            mean_batch_size=self.running_seconds / self.busy_seconds if self.busy_seconds else 0.0,
        )
        return out


@dataclass(slots=True, eq=False)
class Request:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    stream: Stream
    offset: int  # tokens of this turn already in input_ids
    future: asyncio.Future
    created: float = field(default_factory=time.monotonic)
    new: int = 0  # tokens generated by this request
    cached_tokens: int = 0
    admitted: bool = False
    advanced: asyncio.Event | None = None  # a streamed request's: set at each token, and at its end

    def output(self) -> tuple[list[int], list[float]]:
        window = slice(self.offset, self.offset + self.new)
        return self.stream.tokens[window].tolist(), self.stream.logprobs[window].tolist()

    def finish_reason(self) -> dict[str, Any] | None:
        """SGLang checks length before stop tokens."""
        if self.new >= self.max_new_tokens:
            return {"type": "length", "length": self.new}
        if self.offset + self.new >= len(self.stream.tokens):
            return {"type": "stop", "matched": int(self.stream.tokens[-1])}
        return None
