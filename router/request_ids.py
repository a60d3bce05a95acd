"""A response's id, and vLLM's `--enable-request-id-headers`. Torch-free.

    the response's `id`     "cmpl-<id>" / "chatcmpl-<id>": <id> is the request's X-Request-Id header, else its body's
                            `request_id` (vLLM's field), as vLLM names it; else the id the workers got
    X-Request-Id header     with --enable-request-id-headers, on every response (errors too): the request's own, or
                            a fresh one, which the request then carries on (so the header and the `id` agree)

The id the workers see is the gateway's own ("cmpl-" and a fresh uuid4, whatever the client sent): two clients
that send the same id must not meet inside a worker, where ids are unique. A client's id must be printable ASCII
of at most MAX_REQUEST_ID_CHARS characters (a 400 otherwise), since it goes back in a header.
"""

from __future__ import annotations

import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import bad_request

HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 256


def response_id(prefix: str, header_id: str | None, body_id: str | None, *, workers_id: str) -> str:
    """The response's `id` (see the module docstring); a 400 for a client id that is not printable ASCII or too
    long."""
    for value, param in ((header_id, HEADER), (body_id, "request_id")):
        if value is not None:
            if not value or len(value) > MAX_REQUEST_ID_CHARS or not (value.isascii() and value.isprintable()):
                raise bad_request(f"{param} must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters, got "
                                  f"{value!r:.60}", "request_id" if param == "request_id" else None)
            return f"{prefix}-{value}"
    return workers_id


class RequestIdHeaders:
    """Pure ASGI middleware: every HTTP response carries X-Request-Id, the request's own or a fresh uuid4 (hex),
    which is then added to the request's headers for the app to use."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get(HEADER)
        if request_id is None:
            request_id = uuid.uuid4().hex
            scope = {**scope, "headers": [*scope["headers"], (HEADER.lower().encode(), request_id.encode())]}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)
