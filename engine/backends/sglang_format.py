"""SGLang's /generate in Turnstile's terms: its reply (0.5.x, with `return_logprob`) parsed into a
`GenerateResult`, and a prompt's image pads as SGLang takes them."""

from __future__ import annotations

from typing import Any

from engine.backends.base import GenerateResult

FINISH_TYPES = ("stop", "length", "abort")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_generate_reply(body: Any) -> GenerateResult:
    """Turn a `/generate` reply (with `return_logprob`) into a GenerateResult; ValueError names what is wrong.

    Tokens and log-probs come from `meta_info.output_token_logprobs` (`[[logprob, token_id, text], ...]`).
    A request aborted while still queued may come back without counts or log-probs: that is zero tokens.
    """
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ValueError("the reply has no meta_info object")
    meta = body["meta_info"]
    finish = meta.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, dict) else None
    if finish_type not in FINISH_TYPES:
        raise ValueError(f"unknown finish_reason {finish!r}")
    is_abort = finish_type == "abort"

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
    output_ids = body.get("output_ids")
    if output_ids is not None and (not isinstance(output_ids, list) or len(output_ids) != len(token_ids)):
        count = len(output_ids) if isinstance(output_ids, list) else output_ids
        raise ValueError(f"output_ids has {count} tokens but output_token_logprobs has {len(token_ids)}")

    text = body.get("text", "" if is_abort else None)
    if not isinstance(text, str):
        raise ValueError("the reply has no text")
    counts: dict[str, Any] = {}
    for key in ("prompt_tokens", "cached_tokens"):
        counts[key] = meta.get(key, 0 if is_abort else None)
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


def collapse_image_pads(input_ids: list[int], image_token_id: int) -> list[int]:
    """`input_ids` with every run of `image_token_id` cut to one token."""
    return [t for i, t in enumerate(input_ids) if t != image_token_id or i == 0 or input_ids[i - 1] != image_token_id]
