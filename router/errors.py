"""ApiError and OpenAI's JSON error shape; the FastAPI exception handlers that make every error use it.

    {"error": {"message": "...", "type": "BadRequestError", "param": "temperature", "code": 400}}

`type` and `code` follow vLLM's OpenAI server (the HTTP status's error class and number), so clients written
against vLLM read our errors the same way. Bad input is always a 4xx, never a 500.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


@dataclass(kw_only=True, eq=False)  # eq=False: exceptions stay hashable
class ApiError(Exception):
    """A request failed with an HTTP status and a message for the client; `param` names the culprit field."""

    status_code: int
    message: str
    param: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return error_body(self.status_code, self.message, self.param)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(status_code=400, message=message, param=param)


def error_body(status_code: int, message: str, param: str | None = None) -> dict[str, Any]:
    error_type = ERROR_TYPES.get(status_code, "BadRequestError" if status_code < 500 else "InternalServerError")
    return {"error": {"message": message, "type": error_type, "param": param, "code": status_code}}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code)


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
    # loc is ("body", field, ...) for body fields; the field path is what the client wrote.
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = location[0] if location else None
    where = ".".join(location) if location else "body"
    return bad_request(f"{where}: {first.get('msg', 'invalid value')}", param=param)
