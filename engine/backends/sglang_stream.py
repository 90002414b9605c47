"""SGLang's streamed `/generate` (`"stream": true`), read as it arrives (`read_stream`): its server-sent events split
off the bytes (`EventSplitter`), and its chunks joined into one GenerateResult while each chunk's new tokens are
handed on (`StreamedGeneration`).

What the stream holds (SGLang 0.5.23: entrypoints/http_server.py `generate_request`, managers/tokenizer_manager.py
`_handle_batch_output` and `_wait_one_response`): one event `data: <chunk>\\n\\n` per output of the scheduler (every
`--stream-interval` tokens, 1 by default; outputs queued while the client reads slowly go as one), then
`data: [DONE]\\n\\n`. A chunk is `{"text", "output_ids", "meta_info"}` with the meta_info of a non-streamed reply
(`prompt_tokens`, `cached_tokens`, `completion_tokens`: the count so far, `weight_version`, ...), `finish_reason`
null until the last chunk; speculative decoding's counts come on the last only. By default a chunk is cumulative:
`output_ids`, `text` and `meta_info.output_token_logprobs` hold the whole output so far. With the server's
`--incremental-streaming-output` they hold only what is new. An abort (`/abort_request`, a pause in mode "abort", a
client gone) ends the stream with a chunk of finish type "abort"; an abort of a request still queued may repeat
the last token in `output_ids` of an incremental stream. A request refused before it ran is a chunk
`{"error": {"message"}}`, or an abort with an HTTP `status_code` (400 and up): what a non-streamed request gets as
that status.

Which of the two a chunk is, is read from its counts, never assumed: its new tokens are the last
`completion_tokens - received` entries of its log-prob list, a list as long as `completion_tokens` (cumulative) or
as the new tokens (incremental).

Cost: a cumulative chunk grows with the output, so parsing each one whole costs the square of the turn's length
(about 0.5 us a token a chunk: seconds of the event loop for a 4,000-token turn), and orjson holds the GIL, so a
worker thread would not take that off the loop. So once a stream is known to be cumulative, a chunk whose
`finish_reason` is null is not parsed: its new ids are read off the end of its `output_ids` with byte scans, and
it is kept; the last chunk (the final one, or the newest where the stream broke) is parsed whole, and the ids
handed on must be its first ones. Incremental chunks are small and each is parsed whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx2
import orjson

from engine.backends.base import STREAM_BROKEN, GenerateResult, TokenListener, notify
from engine.backends.sglang_format import finish_type_of, generate_result, output_entries
from engine.backends.transport import HTTPServer
from engine.errors import BackendError, ErrorClass

DONE = b"[DONE]"
WHERE = "POST /generate"
_OUTPUT_IDS = b'"output_ids":['
_NOT_FINISHED = b'"finish_reason":null'


class EventSplitter:
    """Server-sent events out of a byte stream: `feed` each piece read, get the data of the events it completed.
    A cumulative chunk can be large, so a piece is searched once and an event's data is copied once."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        search = max(len(self._buffer) - 1, 0)  # an event's blank line may straddle two pieces
        self._buffer += data
        events, begin = [], 0
        while (end := self._buffer.find(b"\n\n", search)) >= 0:
            if (event := _event_data(bytes(self._buffer[begin:end]))) is not None:
                events.append(event)
            begin = search = end + 2
        del self._buffer[:begin]
        return events


def _event_data(block: bytes) -> bytes | None:
    """The data of one event (its `data:` lines joined); None for an event without data (a comment)."""
    if b"\n" not in block:  # one line, as SGLang sends each chunk
        return block[5:].removeprefix(b" ") if block.startswith(b"data:") else None
    lines = [line[5:].removeprefix(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


class ChunkError(Exception):
    """The server sent an error instead of output: `status` is the HTTP status a non-streamed request gets."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class StreamedGeneration:
    """The chunks of one streamed generation, joined: `add` each chunk's data and hand on the ids it returns;
    `result` is set by the last chunk; `broken(why)` is what arrived, as an aborted generation."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []  # handed on so far
        self.logprobs: list[float] = []  # of the tokens of the chunks parsed whole
        self.text = ""
        self.meta: dict[str, Any] = {}  # the newest parsed chunk's meta_info
        self.is_cumulative: bool | None = None  # None until a chunk after the first one with tokens says
        self.result: GenerateResult | None = None
        self._skimmed: bytes | None = None  # the newest chunk, when it was not parsed whole

    def add(self, data: bytes) -> list[int]:
        """One chunk's data (a JSON object); the ids of the tokens it adds. ValueError names a malformed chunk,
        ChunkError carries the server's error."""
        if self.is_cumulative and (ids := self._skim(data)) is not None:
            self._skimmed = data
            self.token_ids += ids
            return ids
        self._skimmed = None
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"a chunk is not JSON: {exc}") from exc
        return self._parse(chunk)

    def broken(self, why: str) -> GenerateResult | None:
        """What arrived before the stream broke, as an aborted generation saying `why` in `meta[STREAM_BROKEN]`;
        None when no token arrived. ValueError when the newest chunk, not parsed yet, is malformed."""
        if not self.token_ids:
            return None
        if self._skimmed is not None:  # its log-probs, text and counts are read now, its ids checked
            self._parse(orjson.loads(self._skimmed))
        meta = {**self.meta, "finish_reason": {"type": "abort", "message": why}, STREAM_BROKEN: why}
        meta.setdefault("prompt_tokens", 0)
        meta.setdefault("cached_tokens", 0)
        return generate_result(meta, list(self.token_ids), list(self.logprobs), self.text)

    def _skim(self, data: bytes) -> list[int] | None:
        """The new ids of a cumulative chunk whose finish_reason is null, read off the end of its `output_ids`
        without parsing the rest; None when the chunk is not shaped so (it is parsed whole)."""
        if _NOT_FINISHED not in data or (start := data.find(_OUTPUT_IDS)) < 0:
            return None
        start += len(_OUTPUT_IDS)
        if (end := data.find(b"]", start)) < 0:
            return None
        new = data.count(b",", start, end) + (end > start) - len(self.token_ids)
        if new <= 0:
            return [] if new == 0 else None
        cut = end
        for _ in range(new):  # back over the new ids, to the comma before the first
            cut = data.rfind(b",", start, cut)
        ids = orjson.loads(b"[" + data[max(cut + 1, start) : end] + b"]")
        return ids if all(type(i) is int for i in ids) else None

    def _parse(self, chunk: Any) -> list[int]:
        if isinstance(chunk, dict) and isinstance(chunk.get("error"), dict):
            raise ChunkError(400, str(chunk["error"].get("message")))
        if not isinstance(chunk, dict) or not isinstance(chunk.get("meta_info"), dict):
            raise ValueError("a chunk has no meta_info object")
        meta = chunk["meta_info"]
        finish = finish_type_of(meta)
        status = (meta["finish_reason"].get("status_code") or 0) if finish == "abort" else 0
        if isinstance(status, int) and status >= 400:
            raise ChunkError(status, str(meta["finish_reason"].get("message")))
        ids, logprobs = output_entries(meta, is_abort=finish in ("abort", None))
        new = self._new_count(meta, len(ids))
        received = len(self.token_ids)
        if len(ids) == received + new:  # the whole output so far
            if ids[:received] != self.token_ids:
                raise ValueError("a chunk's tokens differ from the tokens it streamed before")
            self.logprobs = logprobs
            text = chunk.get("text")
            self.text = text if isinstance(text, str) else self.text
        elif len(ids) == new:  # only what is new
            self.logprobs += logprobs
            self.text += chunk.get("text") or ""
        else:
            raise ValueError(f"a chunk holds {len(ids)} tokens: neither the {received + new} so far nor {new} new")
        if received and new:
            self.is_cumulative = len(ids) == received + new
        fresh = ids[len(ids) - new :]
        self.token_ids += fresh
        self.meta = meta
        if finish is not None:
            self.result = generate_result(meta, list(self.token_ids), list(self.logprobs), self.text)
        return fresh

    def _new_count(self, meta: dict[str, Any], num_entries: int) -> int:
        """How many tokens a chunk adds: `completion_tokens` less those received (a chunk of no tokens may lack
        the count)."""
        total = meta.get("completion_tokens", len(self.token_ids) if num_entries == 0 else None)
        if type(total) is not int or total < len(self.token_ids):
            raise ValueError(f"meta_info.completion_tokens is {total!r}, with {len(self.token_ids)} tokens received")
        return total - len(self.token_ids)


async def read_stream(
    server: HTTPServer, response: httpx2.Response, check: Callable[[Any, Any], None], on_tokens: TokenListener | None
) -> GenerateResult:
    """The streamed /generate `response` of `server`, each chunk's new tokens handed to `on_tokens` as it comes (the
    first chunk's `prompt_tokens` and finish type passed to `check`, which raises to refuse them, before). A stream
    that breaks after tokens came (dropped, cut short, a malformed chunk, an error) returns them as an aborted
    generation saying why in `meta[STREAM_BROKEN]`; before any, it raises the BackendError it is."""
    stream = StreamedGeneration()
    error = await _read_events(server, response, stream, check, on_tokens)
    if error is None:
        assert stream.result is not None
        return stream.result
    try:
        broken = stream.broken(error.message)
    except ValueError as exc:
        raise server.error(ErrorClass.MALFORMED, WHERE, f"{error.message}; then {exc}") from error
    if broken is None:
        raise error
    return broken


async def _read_events(
    server: HTTPServer,
    response: httpx2.Response,
    stream: StreamedGeneration,
    check: Callable[[Any, Any], None],
    on_tokens: TokenListener | None,
) -> BackendError | None:
    """Each chunk of `response` into `stream`, its new tokens to `on_tokens`; the error that ended the stream
    before its last chunk, if one did."""
    events = EventSplitter()
    try:
        async for piece in response.aiter_bytes():
            for data in events.feed(piece):
                if data == DONE:
                    continue
                is_first = not stream.meta
                new = stream.add(data)
                if is_first:
                    check(stream.meta.get("prompt_tokens"), finish_type_of(stream.meta))
                on_tokens = notify(on_tokens, new)
    except httpx2.RequestError as exc:
        return server.failure(WHERE, exc)
    except ChunkError as exc:
        error_class = ErrorClass.SERVER if exc.status >= 500 else ErrorClass.CLIENT
        return server.error(error_class, WHERE, f"HTTP {exc.status} in the stream", exc.message)
    except ValueError as exc:
        return server.error(ErrorClass.MALFORMED, WHERE, str(exc))
    if stream.result is None:
        return server.error(ErrorClass.CONNECTION, WHERE, "the stream ended before its last chunk")
    return None
