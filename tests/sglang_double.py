"""A local HTTP server that answers like SGLang's native API, for unit tests of the HTTP backend.

It is not a simulator: `/generate` answers from a script of reply specs, in the order requests
arrive, and echoes the prompt when the script is empty. Every request is recorded.

    with SGLangDouble() as server:
        server.script(Generate(token_ids=[5, 6], finish="length"), Generate(hold=True))
        ...  # point SGLangBackend at server.url
        server.requests_to("/generate")[0].body["input_ids"]

Reply shapes follow SGLang 0.5.23 (python/sglang/srt/entrypoints/http_server.py and
managers/tokenizer_manager.py): an aborted request answers HTTP 200 with the tokens so far and
`finish_reason.type == "abort"`; `/abort_request` ignores a `rid` it does not hold and, for one it
holds, aborts every held request whose rid starts with it (the tokenizer manager looks the rid up
exactly, the scheduler then matches it as a prefix); `/pause_generation` in mode "abort" aborts every
request; `/health` is 200 or 503 with an empty body; a route SGLang lacks, such as `/workers`, is a 404
with its error body. `/server_info` (and the deprecated `/get_server_info`, `/get_model_info`) answer
as sglang-router's worker registration reads them; the server info leaves out `model_path`, from which
the router would try to load a tokenizer.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Generate:
    """A `/generate` reply built in SGLang's shape.

    `token_ids=None` echoes the request's `input_ids` (cut to `max_new_tokens`). `finish` is the
    finish type written into the reply (anything, to test unknown types). `hold=True` answers only once
    the request is aborted (its rid or a held prefix of it, abort_all, or a pause in mode "abort"), with
    finish type "abort".
    `drop` removes dotted paths from the reply ("meta_info.prompt_tokens"); `output_ids` overrides the
    top-level output_ids (to make lengths disagree); `status` sends the reply with another HTTP status.

    A request with `"stream": true` is answered as SGLang streams (see `SGLangDouble.stream_events`), a chunk
    every `chunk_tokens` tokens (a status other than 200 is answered whole, as SGLang refuses before streaming).
    `stream_hold_after` tokens streamed, it holds until aborted, then ends with finish type "abort" and those
    tokens (`hold=True` holds before the first); `stream_break_after` tokens streamed, it drops the connection.
    """

    token_ids: Sequence[int] | None = None
    logprobs: Sequence[float] | None = None  # default: -0.1, -0.2, ...
    text: str | None = None  # default: "<id> <id> ..."
    finish: str = "stop"
    weight_version: str | None = None  # default: the server's current version
    cached_tokens: int = 0
    delay_s: float = 0.0
    hold: bool = False
    status: int = 200
    drop: tuple[str, ...] = ()
    output_ids: Sequence[int] | None = None
    prompt_tokens: int | None = None  # default: len(input_ids); SGLang counts images expanded
    chunk_tokens: int = 1
    stream_hold_after: int | None = None
    stream_break_after: int | None = None


@dataclass(frozen=True)
class Raw:
    """Any reply: a status and a body (bytes/str sent as is, anything else as JSON)."""

    status: int
    body: Any = b""
    content_type: str = "application/json"


@dataclass(frozen=True)
class Disconnect:
    """Close the connection without answering."""


def error_body(status: int, message: str) -> dict[str, Any]:
    """SGLang's error reply (its ErrorResponse) for a failed request."""
    return {"object": "error", "message": message, "type": str(status), "param": None, "code": status}


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    body: Any
    client_port: int
    headers: dict[str, str]  # names in lower case


@dataclass
class _Held:
    rid: str | None
    released: threading.Event = field(default_factory=threading.Event)


class SGLangDouble:
    """The server; start and stop it with `with`. Attributes tests may set: `healthy`, `weight_version`,
    `incremental_stream` (streamed chunks hold only what is new, as with SGLang's `--incremental-streaming-output`)."""

    def __init__(self, weight_version: str = "default", *, incremental_stream: bool = False):
        self.weight_version: str | None = weight_version
        self.incremental_stream = incremental_stream
        self.healthy = True
        self.paused_mode: str | None = None
        self.health_checked = threading.Event()  # set on every /health request
        self._lock = threading.Condition()
        self._stopping = threading.Event()
        self._script: deque[Generate | Raw | Disconnect] = deque()
        self._endpoint_replies: dict[str, deque[Raw | Disconnect]] = {}
        self._held: list[_Held] = []
        self._requests: list[Recorded] = []
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> SGLangDouble:
        handler = type("Handler", (_Handler,), {"double": self})
        self._server = _Server(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="sglang-double", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release_all()
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    @property
    def url(self) -> str:
        assert self._server is not None, "start the double with `with` first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # -- what tests use --------------------------------------------------------------------------

    def script(self, *replies: Generate | Raw | Disconnect) -> None:
        """Queue replies for the next `/generate` requests, in arrival order."""
        with self._lock:
            self._script.extend(replies)

    def reply_next(self, path: str, reply: Raw | Disconnect) -> None:
        """Answer the next request to `path` (any endpoint but /generate) with `reply`."""
        with self._lock:
            self._endpoint_replies.setdefault(path, deque()).append(reply)

    @property
    def requests(self) -> list[Recorded]:
        with self._lock:
            return list(self._requests)

    def requests_to(self, path: str) -> list[Recorded]:
        return [r for r in self.requests if r.path == path]

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    @property
    def held_rids(self) -> list[str | None]:
        with self._lock:
            return [held.rid for held in self._held]

    def wait_held(self, count: int, timeout: float = 5.0) -> bool:
        """Block until at least `count` requests are held (call from a worker thread in async tests)."""
        with self._lock:
            return self._lock.wait_for(lambda: len(self._held) >= count, timeout)

    def release_all(self) -> None:
        """Let every held or delayed request finish (as aborted) and make new ones answer at once."""
        self._stopping.set()
        self._abort(lambda held: True)

    # -- behaviour -------------------------------------------------------------------------------

    def _record(self, request: Recorded) -> None:
        with self._lock:
            self._requests.append(request)

    def _next_generate(self) -> Generate | Raw | Disconnect:
        with self._lock:
            return self._script.popleft() if self._script else Generate()

    def _next_endpoint_reply(self, path: str) -> Raw | Disconnect | None:
        with self._lock:
            queue = self._endpoint_replies.get(path)
            return queue.popleft() if queue else None

    def _abort(self, matches: Callable[[_Held], bool]) -> None:
        with self._lock:
            for held in [h for h in self._held if matches(h)]:
                held.released.set()
                self._held.remove(held)

    def _hold(self, rid: str | None) -> None:
        held = _Held(rid)
        with self._lock:
            if self._stopping.is_set():
                return
            self._held.append(held)
            self._lock.notify_all()
        held.released.wait()

    def generate_reply(self, spec: Generate, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Run `spec` for `request` (holding or delaying as it says) and build SGLang's reply."""
        started = time.monotonic()
        if spec.delay_s:
            self._stopping.wait(spec.delay_s)
        if spec.hold:
            self._hold(request.get("rid"))
        tokens, logprobs = self._output(spec, request)
        return spec.status, self._reply(spec, request, tokens, logprobs, "abort" if spec.hold else spec.finish, started)

    def stream_events(self, spec: Generate, request: dict[str, Any]) -> Iterator[bytes | None]:
        """Run `spec` for a streamed `request`: SGLang's server-sent events, each `data: <chunk>\n\n`, cumulative
        (or incremental with `incremental_stream`), the last with the finish reason, then `data: [DONE]\n\n`;
        None where the connection is to be dropped."""
        started = time.monotonic()
        if spec.delay_s:
            self._stopping.wait(spec.delay_s)
        tokens, logprobs = self._output(spec, request)
        hold_after = 0 if spec.hold else spec.stream_hold_after
        last = min(n for n in (len(tokens), hold_after, spec.stream_break_after) if n is not None)
        sent = 0
        while sent < last:
            end = min(sent + spec.chunk_tokens, last)
            yield _event(self._reply(spec, request, tokens[:end], logprobs[:end], None, started, sent))
            sent = end
        if spec.stream_break_after is not None and spec.stream_break_after <= sent:
            yield None
            return
        finish = spec.finish
        if hold_after is not None:
            self._hold(request.get("rid"))
            tokens, logprobs, finish = tokens[:sent], logprobs[:sent], "abort"
        yield _event(self._reply(spec, request, tokens, logprobs, finish, started, sent))
        yield b"data: [DONE]\n\n"

    def _output(self, spec: Generate, request: dict[str, Any]) -> tuple[list[int], list[float]]:
        input_ids = list(request.get("input_ids") or [])
        max_new = (request.get("sampling_params") or {}).get("max_new_tokens", len(input_ids))
        tokens = list(input_ids[:max_new] if spec.token_ids is None else spec.token_ids)
        logprobs = list(spec.logprobs if spec.logprobs is not None else [-0.1 * (i + 1) for i in range(len(tokens))])
        return tokens, logprobs

    def _text(self, spec: Generate, request: dict[str, Any], num_tokens: int) -> str:
        """The text of the first `num_tokens` tokens: their ids, or as much of `spec.text` as they are of the
        reply."""
        tokens, _ = self._output(spec, request)
        if spec.text is None:
            return " ".join(map(str, tokens[:num_tokens]))
        return spec.text[: len(spec.text) * num_tokens // max(len(tokens), 1)]

    def _reply(
        self,
        spec: Generate,
        request: dict[str, Any],
        tokens: list[int],
        logprobs: list[float],
        finish_type: str | None,
        started: float,
        sent: int | None = None,
    ) -> dict[str, Any]:
        """SGLang's reply with the output `tokens`, or a streamed chunk of it (`sent` tokens streamed before: an
        incremental chunk holds the rest only; `finish_type` None while the stream goes on)."""
        finish: dict[str, Any] | None = None if finish_type is None else {"type": finish_type}
        if finish_type == "stop":
            finish["matched"] = tokens[-1] if tokens else None
        elif finish_type == "length":
            finish["length"] = len(tokens)
        elif finish_type == "abort":
            finish.update(message="Aborted", status_code=None, err_type=None)
        text = self._text(spec, request, len(tokens))
        output_ids = list(spec.output_ids) if spec.output_ids is not None else tokens
        entries = [[lp, t, None] for lp, t in zip(logprobs, tokens, strict=False)]
        if sent is not None and self.incremental_stream:
            text, output_ids, entries = text[len(self._text(spec, request, sent)) :], output_ids[sent:], entries[sent:]
        input_ids = list(request.get("input_ids") or [])
        meta: dict[str, Any] = {
            "id": request.get("rid") or uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(input_ids) if spec.prompt_tokens is None else spec.prompt_tokens,
            "weight_version": spec.weight_version if spec.weight_version is not None else self.weight_version,
            "completion_tokens": len(tokens),
            "cached_tokens": spec.cached_tokens,
            "e2e_latency": time.monotonic() - started,
        }
        if request.get("return_logprob"):
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = entries
        reply = {"text": text, "output_ids": output_ids, "meta_info": meta}
        for path in spec.drop:
            *parents, last = path.split(".")
            node = reply
            for key in parents:
                node = node[key]
            node.pop(last, None)
        return reply

    def control_reply(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        """The reply of every endpoint but /generate."""
        body = body if isinstance(body, dict) else {}
        if (method, path) == ("GET", "/health"):
            self.health_checked.set()
            return (200 if self.healthy else 503), b""
        if (method, path) in (("GET", "/model_info"), ("GET", "/get_model_info")):
            return 200, {"model_path": "double", "is_generation": True, "weight_version": self.weight_version}
        if (method, path) in (("GET", "/server_info"), ("GET", "/get_server_info")):
            return 200, {"version": "0.5.23", "dp_size": 1, "frontend": "python"}
        if (method, path) == ("POST", "/abort_request"):
            rid = body.get("rid")
            if body.get("abort_all"):
                self._abort(lambda held: True)
            elif rid and rid in self.held_rids:
                self._abort(lambda held: held.rid is not None and held.rid.startswith(rid))
            return 200, b""
        if (method, path) == ("POST", "/pause_generation"):
            self.paused_mode = body.get("mode", "abort")
            if self.paused_mode == "abort":
                self._abort(lambda held: True)
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if (method, path) == ("POST", "/continue_generation"):
            self.paused_mode = None
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if (method, path) == ("POST", "/update_weights_from_disk"):
            version = body.get("weight_version")
            if version is not None:
                self.weight_version = version
            message = "Succeeded to update model weights."
            if version is not None:
                message += f" Weight version updated to {version}."
            return 200, {"success": True, "message": message, "num_paused_requests": 0}
        return 404, error_body(404, "Not Found")  # what SGLang answers for a route it does not have


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # the stdlib's 5 resets concurrent connects; uvicorn listens with 2048

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that hung up is no error
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn does, so the client's pool is exercised
    disable_nagle_algorithm = True  # headers and body go out in two writes
    double: SGLangDouble

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw
        self.double._record(
            Recorded(method, self.path, body, self.client_address[1], {k.lower(): v for k, v in self.headers.items()})
        )

        if (method, self.path) == ("POST", "/generate"):
            spec = self.double._next_generate()
            request = body if isinstance(body, dict) else {}
            if isinstance(spec, Generate) and request.get("stream") and spec.status == 200:
                self._send_stream(self.double.stream_events(spec, request))
                return
            if isinstance(spec, Generate):
                status, reply = self.double.generate_reply(spec, request)
                self._send(status, reply)
                return
        else:
            spec = self.double._next_endpoint_reply(self.path)
            if spec is None:
                self._send(*self.double.control_reply(method, self.path, body))
                return
        if isinstance(spec, Disconnect):
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self._send(spec.status, spec.body, spec.content_type)

    def _send_stream(self, events: Iterator[bytes | None]) -> None:
        """A 200 reply of server-sent `events` in chunked encoding, as uvicorn sends a streaming response; at a
        None the connection is dropped."""
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for event in events:
                if event is None:
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client went away
            self.close_connection = True

    def _send(self, status: int, body: Any, content_type: str = "application/json") -> None:
        if isinstance(body, str):
            body = body.encode()
        elif not isinstance(body, bytes):
            body = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client gave up (a timeout test): nothing to answer
            self.close_connection = True
