"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `APIError`; the exception handlers installed by `install_error_handlers`
turn it, FastAPI's validation errors, Starlette's 404/405 and any unexpected exception
into that shape, so no client ever sees a bare traceback or a non-JSON body. Internal
errors never echo exception text: the body names a request id (also in `X-Request-Id`) and
the server log has that id next to the full exception.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("kvserve.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "server_error",
}


class APIError(Exception):
    """An error to report to the client with a given HTTP status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status_code, "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


# Anthropic's error types by status (its SDK reads `error.type`); /v1/messages answers in that shape.
_ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PATH_PREFIX = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH_PREFIX or path.startswith(ANTHROPIC_PATH_PREFIX + "/")


def anthropic_error_body(status_code: int, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {
            "type": _ANTHROPIC_TYPE_BY_STATUS.get(status_code, "api_error"),
            "message": message,
        },
    }


def error_response(exc: APIError, path: str) -> JSONResponse:
    """`exc` in the error shape of the API that `path` belongs to (OpenAI's, or Anthropic's on /v1/messages)."""
    if is_anthropic_path(path):
        return JSONResponse(
            anthropic_error_body(exc.status_code, exc.message),
            status_code=exc.status_code,
            headers=exc.headers,
        )
    return exc.response()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def internal_error(request_id: str) -> APIError:
    """A 500 that says nothing of the exception (the caller logs it with `request_id`)."""
    return APIError(
        500,
        f"internal server error (request id {request_id}); the server log has the details",
        code="internal_error",
        headers={"X-Request-Id": request_id},
    )


SHUTDOWN_RETRY_AFTER_S = 5


def shutting_down() -> APIError:
    return APIError(
        503,
        "the server is shutting down; retry the request",
        code="server_shutting_down",
        headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)},
    )


def error_bytes(status_code: int, message: str, code: str | None = None, path: str = "") -> bytes:
    """A ready-to-send JSON error body (for the raw ASGI middlewares), in the shape of `path`'s API."""
    if is_anthropic_path(path):
        return json.dumps(anthropic_error_body(status_code, message)).encode()
    body = error_body(message, _TYPE_BY_STATUS.get(status_code, "server_error"), None, code)
    return json.dumps(body).encode()


def _validation_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    # Pydantic names union members in `loc` (e.g. `prompt.str`, `list[int]`); keep the user's field path.
    fields = [
        p
        for p in parts
        if not any(c in p for c in "[]")
        and p not in {"str", "int", "bool", "float"}
        and not p[:1].isupper()
    ]
    return ".".join(fields) or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return (
            f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}",
            None,
        )
    param = _validation_param(tuple(first.get("loc", ())))
    if first.get("type") == "missing" and param is None:
        return "request body is missing or not a JSON object", None
    parts = []
    for err in errors[:3]:
        where = _validation_param(tuple(err.get("loc", ()))) or "body"
        message = str(err.get("msg")).removeprefix(
            "Value error, "
        )  # pydantic's prefix for our own checks
        parts.append(f"{where}: {message}{_got(err.get('input'))}")
    return "; ".join(parts), param


def _got(value: Any) -> str:
    """`, got <the value as JSON>` for a scalar (a short string included), else nothing."""
    if isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 40):
        return f", got {json.dumps(value)}"
    return ""


def install_error_handlers(app: FastAPI) -> None:
    """Map every failure to an OpenAI-shaped JSON error."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(bad_request(message, param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
            code = "not_found"
        elif exc.status_code == 405:
            message = f"Method {request.method} not allowed for {request.url.path}"
            code = "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        return error_response(
            APIError(exc.status_code, message, code=code, headers=getattr(exc, "headers", None)),
            request.url.path,
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = f"err-{uuid.uuid4().hex}"
        if isinstance(
            exc, RecursionError
        ):  # its traceback runs to a thousand frames: one line says as much
            logger.error(
                "unhandled RecursionError in %s %s (request id %s): %s",
                request.method,
                request.url.path,
                request_id,
                exc,
            )
        else:
            logger.error(
                "unhandled error in %s %s (request id %s)",
                request.method,
                request.url.path,
                request_id,
                exc_info=exc,
            )
        return error_response(internal_error(request_id), request.url.path)
