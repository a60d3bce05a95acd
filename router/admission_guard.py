"""AdmissionGuard: a pure ASGI middleware that answers 429 to a generation request arriving while the gateway's
queue is full, before any byte of its body is read.

    POST /v1/completions, /v1/chat/completions, /v1/responses
        queue full (Admission.refuse_on_arrival)  -> 429 + Retry-After, the body and headers that a refusal in
                                                     the dispatcher (Dispatcher.open) sends; the body stays unread
        otherwise                                 -> the app: parse, tokenize, then Admission.acquire, which
                                                     still refuses what the queue cannot hold at its size

Why: at several times its capacity the gateway refuses most requests, and parsing and tokenizing a body it then
refuses cost it as much CPU as one it serves (issue 15's measurement; bench/overload.py measures a refusal's
CPU). A request the guard lets through is checked again at its real size, so the guard only ever answers early
what `acquire` would have answered later. Before the body is parsed, an invalid request (unknown model, bad
parameters) is refused with 429 rather than 400 while the queue is full, as a rate-limited key's is.

The rest of a refused request's body is still on the wire: uvicorn reads and discards it and keeps the
connection (router/body_limit.py says why that is the right end of it).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from router.admission import Admission
from router.errors import ApiError, error_response

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


class AdmissionGuard:
    """Wraps `app`; see the module docstring. `on_refused(reason)` counts each refusal it answers (the request
    failures that `Dispatcher.open` counts for its own)."""

    def __init__(self, app: ASGIApp, *, admission: Admission,
                 on_refused: Callable[[str], None] = lambda _: None) -> None:
        self.app = app
        self.admission = admission
        self._on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATION_PATHS:
            refused = self.admission.refuse_on_arrival()
            if refused is not None:
                self._on_refused(refused.reason)
                await error_response(ApiError.from_refusal(refused))(scope, receive, send)
                return
        await self.app(scope, receive, send)
