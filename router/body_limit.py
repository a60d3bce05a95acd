"""BodyLimit: a pure ASGI middleware that answers 413 for a request body over a size limit, before anything
parses it.

    Content-Length over the limit     -> 413 at once; no byte of the body is buffered
    chunked, and over the limit       -> 413 as soon as the bytes read pass it; no more is buffered
    within the limit                  -> the app gets the whole body, then the client's later messages

The body is buffered here, not counted as the app reads it: FastAPI turns any exception raised while it reads
a body into a 400, so a limit enforced from inside its read could not answer 413. The app would buffer the
whole body anyway (it parses JSON), so buffering it first costs at most one more copy of a bounded body.

After a 413 the rest of the body is still on the wire: uvicorn reads and discards it (memory stays bounded)
and keeps the connection, as Starlette's own limit does. Closing the connection at once instead would make the
kernel reset it over the unread bytes, and the client could lose the 413 it was sent. A proxy in front that
should cut such uploads short does it with its own limit (nginx's client_max_body_size).
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import error_body


class BodyLimit:
    """Wraps `app`; HTTP requests whose body exceeds `max_body_bytes` get a 413 in OpenAI's error shape."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._too_large(scope, receive, send, f"{declared} bytes")
            return
        chunks: list[bytes] = []
        num_bytes = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect: the client left mid-body; nobody to answer
                return
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > self.max_body_bytes:
                await self._too_large(scope, receive, send, f"more than {self.max_body_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _Replay(b"".join(chunks), receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        message = (f"the request body ({size}) is over this server's limit of {self.max_body_bytes} bytes; "
                   "send a shorter prompt")
        response = JSONResponse(error_body(413, message), status_code=413)
        await response(scope, receive, send)


class _Replay:
    """An ASGI receive that gives the buffered body as one message, then passes through the client's next
    messages (http.disconnect, which the app watches for to cancel work for a client that left)."""

    def __init__(self, body: bytes, receive: Receive) -> None:
        self._body: bytes | None = body
        self._receive = receive

    async def __call__(self) -> Message:
        if self._body is None:
            return await self._receive()
        body, self._body = self._body, None
        return {"type": "http.request", "body": body, "more_body": False}


def _content_length(scope: Scope) -> int | None:
    """The declared body size; None when absent or not a number (the HTTP server refuses a malformed one)."""
    value = Headers(scope=scope).get("content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
