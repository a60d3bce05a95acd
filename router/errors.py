"""ApiError and OpenAI's JSON error shape; the FastAPI exception handlers that make every error use it.

    {"error": {"message": "...", "type": "BadRequestError", "param": "temperature", "code": 400}}

`type` and `code` follow vLLM's OpenAI server (the HTTP status's error class and number), so clients written
against vLLM read our errors the same way. Bad input is always a 4xx, never a 500.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

if TYPE_CHECKING:
    from router.admission import AdmissionRefused

logger = logging.getLogger(__name__)

# The OpenAI client's exception class where it has one for the status (BadRequestError, NotFoundError,
# RateLimitError, InternalServerError), else the status's RFC 9110 reason phrase + "Error", as vLLM names them.
ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "ContentTooLargeError",  # RFC 9110's name for it; "Request Entity Too Large" before
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body, as every error of the gateway has it (for the OpenAPI schema)."""

    error: ErrorDetail


# The errors the generation endpoints answer with, for their OpenAPI `responses`.
GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": description}
    for code, description in (
        (400, "a bad parameter, an over-long prompt, text that cannot be encoded"),
        (404, "a model this server does not serve"),
        (413, "a body over the size limit"),
        (429, "the gateway's queue is full; see Retry-After"),
        (503, "no worker can take the request, or it waited in the queue too long (Retry-After)"),
        (504, "the request timed out"),
    )
}


@dataclass(kw_only=True, eq=False)  # eq=False: exceptions stay hashable
class ApiError(Exception):
    """A request failed with an HTTP status and a message for the client; `param` names the culprit field."""

    status_code: int
    message: str
    param: str | None = None
    headers: dict[str, str] | None = None  # e.g. Retry-After on a 429 or 503

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return error_body(self.status_code, self.message, self.param)

    @classmethod
    def from_refusal(cls, refused: AdmissionRefused) -> ApiError:
        """An admission refusal as the client gets it, from the dispatcher and the admission guard alike: 429
        (queue full) or 503 (queued too long) with Retry-After."""
        return cls(status_code=refused.status_code, message=str(refused),
                   headers={"Retry-After": str(refused.retry_after_s)})


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(status_code=400, message=message, param=param)


def error_body(status_code: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object. The message may quote the client's input, which may hold lone surrogates: they
    are written as escapes (\\ud800), so the body always encodes as UTF-8 and the error never becomes a 500."""
    error_type = ERROR_TYPES.get(status_code, "BadRequestError" if status_code < 500 else "InternalServerError")
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": error_type, "param": param, "code": status_code}}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error FastAPI can raise into the OpenAI shape: validation and malformed JSON -> 400,
    unknown routes -> 404, wrong methods -> 405, anything unexpected -> 500 (logged with its traceback)."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, error: ApiError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(_from_validation_error(error))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        message = str(error.detail) if error.detail else "error"
        return JSONResponse(error_body(error.status_code, message), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error serving %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(error).__name__}"), status_code=500)


def _from_validation_error(error: RequestValidationError) -> ApiError:
    errors = error.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    # A union field (stop: str | list[str]) fails once per member, the member's tag in the loc: the first
    # failure is usually "not a string" while the list member says what is wrong (too many items, a bad item).
    # So: the first error of the first failing field that is more than a type mismatch, if there is one.
    field = first.get("loc", ())[:2]
    specific = (e for e in errors if e.get("loc", ())[:2] == field and not str(e.get("type", "")).endswith("_type"))
    first = next(specific, first)
    # loc is ("body", field, ...) for body fields; the field path is what the client wrote, less union tags.
    location = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_tag(part)]
    param = location[0] if location else None
    where = ".".join(location) if location else "body"
    return bad_request(f"{where}: {first.get('msg', 'invalid value')}", param=param)


def _is_union_tag(part: object) -> bool:
    """pydantic names a union member in a loc by its type ('str', 'list[int]', 'ContentPart'); a field name is
    lowercase snake_case and never one of these."""
    return isinstance(part, str) and (part in _SCALAR_TAGS or "[" in part or part[:1].isupper())


_SCALAR_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def without_validation_errors(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """`app.openapi` without FastAPI's 422 responses: a body that fails validation is a 400 here (see
    `install_error_handlers`), which the routes declare themselves."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi
