"""Raw ASGI middlewares: API-key check and request-body size and nesting limits.

They are plain ASGI (not Starlette's BaseHTTPMiddleware) so that the handlers' `receive`
channel stays intact: the disconnect watch in `server.streaming` relies on it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import error_bytes
from kvserve.server.json_depth import MAX_JSON_DEPTH, json_depth, too_deep_message

OPEN_PATHS = frozenset({"/health", "/metrics"})
# The ASGI scope key under which an authenticated request carries its API key's tenant tag.
TENANT_SCOPE_KEY = "kvserve.tenant"


async def send_error(
    send: Send,
    status: int,
    message: str,
    code: str | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
    path: str = "",
) -> None:
    body = error_bytes(status, message, code, path)
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send(
        {"type": "http.response.start", "status": status, "headers": raw_headers + (headers or [])}
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def tenant_tags(api_keys: Sequence[str]) -> list[str]:
    """One tag per key: HMAC-SHA256 of the key under a secret drawn at start-up, so that the tag
    (which travels with requests to the engine) says nothing about the key, even a guessable one."""
    secret = secrets.token_bytes(32)
    return [hmac.new(secret, key.encode(), hashlib.sha256).hexdigest() for key in api_keys]


def bearer_token(authorization: bytes) -> bytes:
    """The credentials of an `Authorization: Bearer <token>` header value (b"" for another scheme).
    The scheme name is case-insensitive (RFC 7235: `bearer` and `BEARER` are `Bearer`)."""
    scheme, _, token = authorization.partition(b" ")
    return token.lstrip(b" ") if scheme.lower() == b"bearer" else b""


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches one of the keys; /health, /metrics (unless
    `protect_metrics`) and CORS preflights stay open. With `tag_tenants`, an accepted request
    carries its key's tag in `scope[TENANT_SCOPE_KEY]` (the raw key goes nowhere)."""

    def __init__(
        self,
        app: ASGIApp,
        api_keys: Sequence[str],
        protect_metrics: bool = False,
        tag_tenants: bool = False,
    ) -> None:
        if not api_keys:
            raise ValueError("APIKeyMiddleware needs at least one API key")
        self.app = app
        tags = tenant_tags(api_keys) if tag_tenants else [None] * len(api_keys)
        self.expected = [(key.encode(), tag) for key, tag in zip(api_keys, tags)]
        self.open_paths = OPEN_PATHS - {"/metrics"} if protect_metrics else OPEN_PATHS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] in self.open_paths
            or scope["method"] == "OPTIONS"
        ):
            await self.app(scope, receive, send)
            return
        token = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                token = bearer_token(value)
                break
            if name == b"x-api-key":  # how Anthropic's clients send the key (/v1/messages)
                token = value
        is_valid, tenant = False, None
        for (
            expected,
            tag,
        ) in self.expected:  # every key is compared: the time says nothing of which matched
            if hmac.compare_digest(token, expected):
                is_valid, tenant = True, tag
        if not is_valid:
            await send_error(
                send,
                401,
                "Incorrect or missing API key. Send it as 'Authorization: Bearer KEY'.",
                code="invalid_api_key",
                headers=[(b"www-authenticate", b"Bearer")],
                path=scope["path"],
            )
            return
        if tenant is not None:
            scope = {**scope, TENANT_SCOPE_KEY: tenant}
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over `max_bytes` (by Content-Length, and by counting what actually arrives);
    400 `json_too_deep` for bodies nesting arrays and objects deeper than `max_json_depth`, found on
    the raw bytes before anything parses or walks them (`server.json_depth`).

    The body is read here in full and replayed to the app, after which `receive` passes
    through (so the app still sees `http.disconnect`).
    """

    def __init__(self, app: ASGIApp, max_bytes: int, max_json_depth: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_json_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await send_error(send, 400, "invalid Content-Length header", path=scope["path"])
                    return
                if length > self.max_bytes:
                    await self._too_large(send, scope["path"])
                    return
        chunks: list[bytes] = []
        num_bytes = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > self.max_bytes:
                await self._too_large(send, scope["path"])
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if json_depth(body, self.max_json_depth) > self.max_json_depth:
            await send_error(
                send,
                400,
                too_deep_message(depth_limit=self.max_json_depth),
                code="json_too_deep",
                path=scope["path"],
            )
            return
        is_replayed = False

        async def replay() -> Message:
            nonlocal is_replayed
            if not is_replayed:
                is_replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, path: str) -> None:
        await send_error(
            send,
            413,
            f"request body is larger than {self.max_bytes} bytes",
            code="request_too_large",
            path=path,
        )
