"""The published OpenAPI document, made to match what the server sends.

FastAPI documents a 422 for every route with a body and knows nothing of the errors that
middlewares and handlers send. Here each route declares its real answers: 400 with the
OpenAI error body (`server.errors` turns validation errors into 400s), 404 for an unknown
model, 413 for an oversized body, 503 for overload, drain or a dead engine, 401 when
`--api-key` is set; the completion routes' 200 has the response schema as JSON and, for
`stream: true`, a `text/event-stream` variant. `tests/test_openapi_schema.py` runs
schemathesis against the served app to keep the two in step.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from server.protocol import ErrorResponse

_DESCRIPTIONS = {
    400: "Invalid request (OpenAI error body; `param` names the field)",
    401: "Missing or wrong API key (`--api-key`)",
    404: "The model is not served",
    413: "Request body over `--max-body-bytes`",
    500: "Internal error in this request",
    503: "Overloaded (`--max-queue`, with Retry-After), shutting down, or the engine is dead",
}
_UNPROTECTED_PATHS = ("/health", "/metrics")   # reachable without the API key


def errors(*status_codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for these error statuses, each with the OpenAI error body."""
    return {code: {"model": ErrorResponse, "description": _DESCRIPTIONS[code]} for code in status_codes}


def streamed(model: type, event_description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that is `model` as JSON, or server-sent events when the request says `stream: true`."""
    return {200: {"model": model, "description": "The response (JSON), or server-sent events with `stream: true`",
                  "content": {"text/event-stream": {"schema": {"type": "string", "description": event_description}}}}}


def install_openapi(app: FastAPI, has_api_key: bool) -> None:
    """Replace `app.openapi` by one without FastAPI's 422s (and with 401s where `has_api_key`)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _fix(schema, has_api_key)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _fix(schema: dict[str, Any], has_api_key: bool) -> None:
    error_ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if has_api_key and path not in _UNPROTECTED_PATHS:
                responses["401"] = {"description": _DESCRIPTIONS[401], **error_ref}
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
