"""An sglang-router's workers, and telling a router from an SGLang server.

`GET /workers` tells them apart: sglang-router (0.3.2) answers `{"workers": [{"url": ..., "is_healthy": ...},
...], "total": n, ...}`; an SGLang server (0.5.23) has no such route and answers 404. The router registers
each worker in the background (it checks the worker's /health and reads its /model_info and /server_info)
and lists it only once registered, so a router whose workers are unreachable lists none.
"""

from __future__ import annotations

from engine.backends.transport import HTTPServer, excerpt
from engine.errors import BackendError, ErrorClass


async def list_workers(server: HTTPServer) -> list[str] | None:
    """The worker URLs the router at `server` lists now, or None when `server` is an SGLang server.

    Raises BackendError when it cannot be reached, answers as neither, or is a router that lists no worker."""
    where = "GET /workers"
    try:
        response = await server.served("/workers")
    except BackendError as exc:
        raise exc.noted("asked to tell an SGLang server from an sglang-router") from exc
    if response is None:
        return None
    reply = server.json(where, response)
    workers = reply.get("workers") if isinstance(reply, dict) else None
    if not isinstance(workers, list) or not all(isinstance(w, dict) and isinstance(w.get("url"), str) for w in workers):
        raise server.error(ErrorClass.MALFORMED, where, "not an sglang-router's worker list", response.text)
    if not workers:
        detail = "no worker has registered with it yet, or none is reachable from it"
        message = f"sglang-router at {server.url} lists no workers ({where}: {excerpt(response.text)}): {detail}"
        raise BackendError(ErrorClass.CONNECTION, message)
    return list(dict.fromkeys(w["url"].rstrip("/") for w in workers))
