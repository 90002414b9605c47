"""SGLang's streamed `/generate` (`"stream": true`), read as it arrives: its server-sent events split off the bytes
(`EventSplitter`), and its chunks joined into one GenerateResult while each chunk's new tokens are handed on
(`StreamedGeneration`).

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

from typing import Any

import orjson

from engine.backends.base import STREAM_BROKEN, GenerateResult
from engine.backends.sglang_format import finish_type_of, generate_result, output_entries

DONE = b"[DONE]"
_OUTPUT_IDS = b'"output_ids":['
_NOT_FINISHED = b'"finish_reason":null'


class EventSplitter:
    """Server-sent events out of a byte stream: `feed` each piece read, get the data of the events it completed."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        end = self._buffer.rfind(b"\n\n")
        if end < 0:
            return []
        complete = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        events = []
        for block in complete.split(b"\n\n"):
            lines = [line[5:].removeprefix(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
            if lines:
                events.append(b"\n".join(lines))
        return events


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
        end = data.find(b"]", start)
        new = data.count(b",", start, end) + (end > start) - len(self.token_ids)
        if end < 0 or new < 0:
            return None
        cut = end
        for _ in range(new):  # back over the new ids, to the comma before the first
            cut = data.rfind(b",", start, cut)
        return orjson.loads(b"[" + data[max(cut + 1, start) : end] + b"]") if new else []

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
