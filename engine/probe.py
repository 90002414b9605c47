"""A family the engine has no parser for, read off its chat template: render structured calls (OpenAI's form) and
a reasoned reply with sentinel names, keys and values, and find the literal text the template writes around each
part (engine/parsers/probed.py's `Layout`). The model was trained on what its template writes, so that is how it
writes a call. The layout found is checked by parsing the probes back; where no layout reads them, the probe says
why, and an env that reads tool calls is refused at start with that reason.

    layout, problem = probe_layout(encoder)     # (Layout, None) or (None, "the template writes no tool calls")
"""

from __future__ import annotations

import json
import os
from typing import Any, Protocol

from engine.parsers.base import MalformedCall
from engine.parsers.probed import Layout, ProbedParser


class Renderer(Protocol):
    """What the probe needs of an encoder (engine/encoding.py's ChatEncoder, which calls it)."""

    end_texts: tuple[str, ...]

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str: ...

    def tool_call(self, call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]: ...


# Sentinels: words no template writes, with no common prefix or suffix between any two.
NAMES = ("fnalpha", "fnbravo")
KEYS = ("kcharlie", "kdelta")
VALUES = ("vecho", "vfoxtrot")
REASONING, CONTENT = "rgolfthought", "chotelanswer"
CONTEXT = ({"role": "user", "content": "Hello."},)


def probe_layout(encoder: Renderer) -> tuple[Layout | None, str | None]:
    """The template's call layout, checked by parsing its own probes back; or None and why not."""
    try:
        lead = _content_lead(encoder)
        layout = _layout(encoder, lead)
    except ProbeFailed as failed:
        return None, str(failed)
    except Exception as exc:  # noqa: BLE001 -- a template that raises on a structured call writes none
        return None, f"the template raises on a structured tool call: {' '.join(str(exc).split())[:200]}"
    problem = _reads_back(encoder, layout, lead)
    return (layout, None) if problem is None else (None, problem)


class ProbeFailed(ValueError):
    pass


def written(encoder: Renderer, message: dict[str, Any]) -> str:
    """What the template writes for `message` as the reply after a user's, up to its end token."""
    before = encoder.render(list(CONTEXT), add_generation_prompt=True)
    after = encoder.render([*CONTEXT, message], add_generation_prompt=False)
    text = after[len(os.path.commonprefix([before, after])) :]
    cuts = [at for end in encoder.end_texts if (at := text.find(end)) >= 0]
    return text[: min(cuts)] if cuts else text


def _with_calls(encoder: Renderer, calls: list[tuple[str, dict[str, Any]]], content: str = "") -> str:
    """What the template writes for a reply of `content` that makes `calls` (name, arguments), in OpenAI's form."""
    structured = [encoder.tool_call(f"call{i:05d}", name, args) for i, (name, args) in enumerate(calls)]
    return written(encoder, {"role": "assistant", "content": content, "tool_calls": structured})


def _calls(encoder: Renderer, *calls: tuple[str, dict[str, Any]]) -> str:
    text = _with_calls(encoder, list(calls))
    if NAMES[0] not in text:
        raise ProbeFailed("the template writes no structured tool calls")
    return text


def _layout(encoder: Renderer, lead: str) -> Layout:
    (n1, n2), (k1, k2), (v1, v2) = NAMES, KEYS, VALUES
    one = _calls(encoder, (n1, {k1: v1}))
    two_args = _calls(encoder, (n1, {k1: v1, k2: v2}))
    two_calls = _calls(encoder, (n1, {k1: v1}), (n2, {k1: v1}))
    reasoning = _reasoning(encoder)
    prefix = _without_lead(one[: one.index(n1)], lead)
    if (json_layout := _json_layout(one, two_calls, prefix, reasoning)) is not None:
        return json_layout
    at_n, at_k = one.index(n1), one.find(k1)
    at_v = one.find(v1, at_k)
    if not 0 <= at_n < at_k < at_v:
        raise ProbeFailed("the template does not write a call's name, then its arguments' names and values")
    before_key = one[at_n + len(n1) : at_k]  # name_close + arg_open
    arg_sep = one[at_k + len(k1) : at_v]
    v1_end = two_args.index(v1) + len(v1)
    between_args = two_args[v1_end : two_args.index(k2, v1_end)]  # arg_close + arg_open
    arg_open = _common_suffix(between_args, before_key)
    if not arg_open.strip():
        raise ProbeFailed("the template writes no marker before an argument's name")
    arg_close, name_close = between_args[: -len(arg_open)], before_key[: -len(arg_open)]
    after_args = one[at_v + len(v1) :]
    v1_end = two_calls.index(v1) + len(v1)
    between_calls = two_calls[v1_end : two_calls.index(n2, v1_end)]  # arg_close + call_close + call_open
    if not (after_args.startswith(arg_close) and between_calls.startswith(arg_close)):
        raise ProbeFailed("the template ends an argument differently before the next one and at the call's end")
    around = _around_calls(prefix, between_calls[len(arg_close) :], after_args[len(arg_close) :])
    return Layout(**around, **reasoning, name_close=name_close, arg_open=arg_open, arg_sep=arg_sep, arg_close=arg_close)


def _json_layout(one: str, two_calls: str, prefix: str, reasoning: dict[str, str]) -> Layout | None:
    """A layout whose arguments are one JSON object after the name (Hermes' `{"name": ..., "arguments": {...}}`)."""
    k1, v1 = KEYS[0], VALUES[0]
    for dumped in (json.dumps({k1: v1}), json.dumps({k1: v1}, separators=(",", ":"))):
        if dumped in one and dumped in two_calls and one.index(NAMES[0]) < one.index(dumped):
            at = one.index(dumped)
            name_close = one[one.index(NAMES[0]) + len(NAMES[0]) : at]
            end = two_calls.index(dumped) + len(dumped)
            between_calls = two_calls[end : two_calls.index(NAMES[1], end)]
            around = _around_calls(prefix, between_calls, one[at + len(dumped) :])
            return Layout(
                **around, **reasoning, name_close=name_close, arg_open="", arg_sep="", arg_close="",
                json_arguments=True,
            )  # fmt: skip
    return None


def _around_calls(prefix: str, between_calls: str, after: str) -> dict[str, str]:
    """The section and each call's opening and closing, from what precedes the first call's name (`prefix`), what
    lies between the first call's arguments and the second's name, and what follows the only call's arguments."""
    call_open = _common_suffix(between_calls, prefix)
    if not call_open.strip():
        raise ProbeFailed("the template writes no marker before a call's name")
    call_close = os.path.commonprefix([between_calls[: -len(call_open)], after])
    return {
        "section_open": prefix[: -len(call_open)], "call_open": call_open, "call_close": call_close,
        "section_close": after[len(call_close) :].rstrip(),
    }  # fmt: skip


def _reasoning(encoder: Renderer) -> dict[str, str]:
    """The reasoning block's markers, where the template writes a reply's reasoning before its content."""
    message = {"role": "assistant", "content": CONTENT, "reasoning_content": REASONING}
    text = written(encoder, message)
    if REASONING not in text or CONTENT not in text or text.index(REASONING) > text.index(CONTENT):
        return {"reasoning_open": "", "reasoning_close": ""}
    opener = text[: text.index(REASONING)].strip()
    closer = text[text.index(REASONING) + len(REASONING) : text.index(CONTENT)].strip()
    if not opener and closer.startswith("</"):  # the generation prompt opened the block: its opener is there
        whole = encoder.render([*CONTEXT, message], add_generation_prompt=False)
        if whole[: whole.index(REASONING)].rstrip().endswith(f"<{closer[2:]}"):
            opener = f"<{closer[2:]}"
    return {"reasoning_open": opener, "reasoning_close": closer}


def reasoning_markers(encoder: Renderer) -> dict[str, str]:
    """The reasoning block's markers (`reasoning_open`, `reasoning_close`), "" where the template writes none or
    fails on a reasoned reply."""
    try:
        return _reasoning(encoder)
    except Exception:  # noqa: BLE001 -- a template that raises on a reasoned reply writes no reasoning to read
        return {"reasoning_open": "", "reasoning_close": ""}


def _content_lead(encoder: Renderer) -> str:
    """What the template writes before any reply's content (an empty reasoning block, `</think>`), stripped."""
    plain = written(encoder, {"role": "assistant", "content": CONTENT})
    return plain[: plain.index(CONTENT)].strip() if CONTENT in plain else ""


def _without_lead(text: str, lead: str) -> str:
    """`text` without the `lead` the template writes before any reply (`_content_lead`)."""
    stripped = text.lstrip()
    return stripped[len(lead) :] if lead and stripped.startswith(lead) else text


def _common_suffix(a: str, b: str) -> str:
    return os.path.commonprefix([a[::-1], b[::-1]])[::-1]


def _reads_back(encoder: Renderer, layout: Layout, lead: str) -> str | None:
    """None when the layout reads the template's own probes back (names, arguments, the content before); else why
    not."""
    parser = ProbedParser(layout)
    (n1, n2), (k1, k2), (v1, v2) = NAMES, KEYS, VALUES
    cases = [
        ([(n1, {k1: v1})], ""),
        ([(n1, {k1: v1, k2: v2})], ""),
        ([(n1, {k1: v1}), (n2, {k2: v2})], ""),
        ([(n2, {k1: v1})], CONTENT),
    ]
    for calls, content in cases:
        text = _with_calls(encoder, calls, content)
        try:
            read = parser.parse(_without_lead(text, lead))
        except MalformedCall as exc:
            return f"the layout found does not read the template's own call back: {exc.detail}"
        if [(c.name, c.arguments) for c in read.tool_calls] != calls or read.content != content:
            return f"the layout found reads the template's own call back otherwise: {text[:120]!r}"
    return None
