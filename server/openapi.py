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
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvserve.server.errors import is_anthropic_path
from kvserve.server.protocol import AnthropicErrorResponse, ChatCompletionChunk, ErrorResponse

_DESCRIPTIONS = {
    400: "Invalid request (OpenAI error body; `param` names the field)",
    401: "Missing or wrong API key (`--api-key`)",
    404: "The model is not served",
    413: "Request body over `--max-body-bytes`",
    500: "Internal error in this request",
    503: "Overloaded (`--max-queue`, with Retry-After), shutting down, or the engine is dead",
}
_UNPROTECTED_PATHS = ("/health", "/metrics")  # reachable without the API key
_EXTRA_MODELS = (
    ChatCompletionChunk,
    ErrorResponse,
    AnthropicErrorResponse,
)  # referenced only from SSE events


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def errors(*status_codes: int, anthropic: bool = False) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for these error statuses, each with the OpenAI error body (Anthropic's
    with `anthropic`: the /v1/messages routes)."""
    model = AnthropicErrorResponse if anthropic else ErrorResponse
    return {code: {"model": model, "description": _DESCRIPTIONS[code]} for code in status_codes}


def named_events(description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that is a JSON object, or with `stream: true` named server-sent events
    (`event: NAME` and `data: {json}`), as the Responses and Anthropic Messages APIs stream."""
    event = {
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": {"type": "string"},
            "data": {"type": "string", "contentMediaType": "application/json"},
        },
    }
    return {
        200: {
            "description": description,
            "content": {
                "application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": event},
            },
        }
    }


def streamed(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A 200 that is `model` as JSON, or server-sent events when the request says `stream: true`.

    The event schema (OpenAPI 3.1 has no `itemSchema`, so `schema` describes one event): `data`
    is a JSON `chunk`, an error body (an error after the stream started), or the final `[DONE]`.
    """
    payload = {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": payload,
                    },
                ]
            }
        },
    }
    return {
        200: {
            "model": model,
            "description": f"The response (JSON), or with `stream: true` server-sent "
            f"events: `data: {{{chunk.__name__}}}` ..., then `data: [DONE]`",
            "content": {"text/event-stream": {"schema": event}},
        }
    }


def install_openapi(app: FastAPI, has_api_key: bool, protects_metrics: bool = False) -> None:
    """Replace `app.openapi` by one without FastAPI's 422s (and with 401s where `has_api_key`;
    on /metrics too with `protects_metrics`)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _fix(schema, has_api_key, ("/health",) if protects_metrics else _UNPROTECTED_PATHS)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _fix(schema: dict[str, Any], has_api_key: bool, open_paths: tuple[str, ...]) -> None:
    for path, operations in schema.get("paths", {}).items():
        model = "AnthropicErrorResponse" if is_anthropic_path(path) else "ErrorResponse"
        error_ref = {
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}}
        }
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if has_api_key and path not in open_paths:
                responses["401"] = {"description": _DESCRIPTIONS[401], **error_ref}
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    _, extra = models_json_schema(
        [(model, "serialization") for model in _EXTRA_MODELS],
        ref_template="#/components/schemas/{model}",
    )
    for name, definition in extra.get("$defs", {}).items():
        components.setdefault(name, definition)
