"""SGLang's /generate in Turnstile's terms: the request body as JSON bytes, its reply (0.5.x, with
`return_logprob`) parsed into a `GenerateResult`, and a prompt's image pads as SGLang takes them.

A request carries every image of the conversation so far, each turn again, so the body is built from
parts: the ids and sampling parameters are serialised by orjson each turn, each image payload's JSON
string once (`JSONStrings`), and the parts joined. A large body (THREAD_MIN_BYTES) is built in a worker
thread, where the join's copy runs without the GIL (`bytes.join` drops it from 1 MiB on); orjson holds
the GIL wherever it runs, which is why a payload is serialised once rather than in a thread every turn.
The body is the JSON httpx2's `json=` sends (`{"input_ids", "sampling_params", "return_logprob", "rid"[,
"stream"][, "image_data"]}`, compact, UTF-8), byte for byte but for the spelling of some floats (1e-05 as
0.00001). A streamed reply is read by engine/backends/sglang_stream.py.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from engine.backends.base import GenerateResult
from engine.multimodal import BoundedCache

FINISH_TYPES = ("stop", "length", "abort")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def output_entries(meta: dict[str, Any], is_abort: bool) -> tuple[list[int], list[float]]:
    """The token ids and log-probs of `meta_info.output_token_logprobs` (`[[logprob, token_id, text], ...]`),
    which may be missing only from an abort."""
    entries = meta.get("output_token_logprobs", [] if is_abort else None)
    if not isinstance(entries, list):
        raise ValueError("meta_info.output_token_logprobs is missing (was return_logprob sent?)")
    token_ids: list[int] = []
    logprobs: list[float] = []
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) >= 2 and _number(entry[0]) and type(entry[1]) is int):
            raise ValueError(f"bad output_token_logprobs entry {entry!r}")
        logprobs.append(float(entry[0]))
        token_ids.append(entry[1])
    return token_ids, logprobs


def parse_generate_reply(body: Any) -> GenerateResult:
    """Turn a `/generate` reply (with `return_logprob`) into a GenerateResult; ValueError names what is wrong.

    Tokens and log-probs come from `meta_info.output_token_logprobs` (`[[logprob, token_id, text], ...]`).
    A request aborted while still queued may come back without counts or log-probs: that is zero tokens.
    """
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ValueError("the reply has no meta_info object")
    meta = body["meta_info"]
    finish_type = finish_type_of(meta)
    if finish_type is None:
        raise ValueError("unknown finish_reason None")
    is_abort = finish_type == "abort"

    token_ids, logprobs = output_entries(meta, is_abort)
    output_ids = body.get("output_ids")
    if output_ids is not None and (not isinstance(output_ids, list) or len(output_ids) != len(token_ids)):
        count = len(output_ids) if isinstance(output_ids, list) else output_ids
        raise ValueError(f"output_ids has {count} tokens but output_token_logprobs has {len(token_ids)}")

    text = body.get("text", "" if is_abort else None)
    if not isinstance(text, str):
        raise ValueError("the reply has no text")
    return generate_result(meta, token_ids, logprobs, text)


def finish_type_of(meta: dict[str, Any]) -> str | None:
    """`meta_info.finish_reason`'s type: None while a streamed generation goes on; ValueError if unknown."""
    finish = meta.get("finish_reason")
    if finish is None:
        return None
    finish_type = finish.get("type") if isinstance(finish, dict) else None
    if finish_type not in FINISH_TYPES:
        raise ValueError(f"unknown finish_reason {finish!r}")
    return finish_type


def generate_result(meta: dict[str, Any], token_ids: list[int], logprobs: list[float], text: str) -> GenerateResult:
    """The GenerateResult of a finished generation's `meta_info` and its output, read already."""
    finish_type = finish_type_of(meta)
    if finish_type is None:
        raise ValueError("the generation has no finish_reason")
    counts: dict[str, Any] = {}
    for key in ("prompt_tokens", "cached_tokens"):
        counts[key] = meta.get(key, 0 if finish_type == "abort" else None)
        if type(counts[key]) is not int:
            raise ValueError(f"meta_info.{key} is missing or not an integer")
    weight_version = meta.get("weight_version")
    return GenerateResult(
        token_ids=token_ids,
        logprobs=logprobs,
        text=text,
        finish_reason=finish_type,
        weight_version=None if weight_version is None else str(weight_version),
        meta={key: value for key, value in meta.items() if not key.endswith("_logprobs")},
        **counts,
    )


def collapse_image_pads(input_ids: Sequence[int] | np.ndarray, image_token_id: int) -> np.ndarray:
    """`input_ids` with every run of `image_token_id` cut to one token (a 1-d integer array)."""
    ids = token_array(input_ids)
    keep = ids != image_token_id
    keep[1:] |= keep[:-1]  # a pad stays when the token before it is no pad (numpy reads `keep` before writing)
    if len(keep):
        keep[0] = True
    return ids[keep]


def token_array(input_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a 1-d integer array: a copy of a buffer (`array("i")`, an ndarray), or read from a sequence."""
    if isinstance(input_ids, np.ndarray | array.array | memoryview):
        ids = np.array(input_ids)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be a 1-d array of integers, got shape {ids.shape} of {ids.dtype}")
        return ids
    return np.fromiter(input_ids, dtype=np.int64, count=len(input_ids))


DEFAULT_JSON_CACHE_BYTES = 256 << 20
# Bodies from this size on are built in a worker thread: the join's copy (about 0.07 ms a MiB) then costs the loop
# nothing, as bytes.join releases the GIL from 1 MiB on when every part is bytes, and a thread hop (~65 us of loop
# time) costs less than joining 2 MiB (~0.14 ms). benchmarks/micro/payloads.py measures both.
THREAD_MIN_BYTES = 2 << 20


def json_string(text: str) -> bytes:
    """`text` as a JSON string: quoted, escaped, UTF-8."""
    return orjson.dumps(text)


class JSONStrings:
    """Image payloads as JSON strings, each serialised once while it stays cached (they are sent again every turn
    of their trajectory). Keyed by the payload text (a trajectory passes the same string objects every turn, so
    the lookup hashes each once); bounded by `max_bytes`, least recently used out first; thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_JSON_CACHE_BYTES):
        self._cache: BoundedCache[str, bytes] = BoundedCache(max_bytes)

    def __len__(self) -> int:
        return len(self._cache)

    def __call__(self, text: str) -> bytes:
        encoded = self._cache.get(text)
        if encoded is None:
            encoded = json_string(text)
            self._cache.put(text, encoded)
        return encoded


def body_size(input_ids: Sequence[int], image_data: Sequence[str] | None) -> int:
    """About how many bytes `generate_body` makes (an id takes up to 7)."""
    return 7 * len(input_ids) + sum(len(p) + 3 for p in image_data or ())


def generate_body(
    input_ids: Sequence[int] | np.ndarray,
    sampling_params: dict[str, Any],
    rid: str,
    image_data: Sequence[str] | None = None,
    *,
    image_token_id: int | None = None,
    strings: JSONStrings | None = None,
    stream: bool = False,
) -> tuple[bytes, int]:
    """The /generate request as JSON bytes, and how many prompt tokens it sends (`"stream": true` too, with
    `stream`).

    With `image_data`, it goes last in the body; given `image_token_id`, each run of that token in `input_ids` is
    sent as one (SGLang expands each image's placeholder itself). `strings` serialises the payloads (default:
    each anew). Thread-safe; run it in a worker thread when `body_size` reaches THREAD_MIN_BYTES."""
    if image_data and image_token_id is not None:
        ids: Any = collapse_image_pads(input_ids, image_token_id)
    elif isinstance(input_ids, list):
        ids = input_ids
    elif isinstance(input_ids, np.ndarray | array.array | memoryview):
        ids = token_array(input_ids)
    else:
        ids = list(input_ids)
    head = {"input_ids": ids, "sampling_params": sampling_params, "return_logprob": True, "rid": rid}
    if stream:
        head["stream"] = True
    encoded = orjson.dumps(head, option=orjson.OPT_SERIALIZE_NUMPY)
    if image_data is None:
        return encoded, len(ids)
    to_json = json_string if strings is None else strings
    # the head without its closing brace; a bytes copy, not a memoryview, which would keep join from releasing the GIL
    parts = [encoded[:-1], b',"image_data":[']
    for i, payload in enumerate(image_data):
        if i:
            parts.append(b",")
        parts.append(to_json(payload))
    parts.append(b"]}")
    return b"".join(parts), len(ids)
