"""Server-sent events and client-disconnect handling.

A request's engine work must stop as soon as its client goes away, streaming or not,
so that its KV blocks return to the pool. Both paths race the work against an
`http.disconnect` message from the ASGI `receive` channel and cancel the loser; the
cancelled generator's `finally` aborts its engine requests (see `server.serving`).
A client that stays connected but stops reading is cut by the connection's stall timer
(`server.connections`), which uvicorn reports here as `http.disconnect`.

Why not sse-starlette's `EventSourceResponse`: it cancels the stream through an anyio task
group, whose cancellation is level-triggered, so every `await` in the event generator's
cleanup (aborting the engine requests, releasing the admission seat) is cancelled again and
that cleanup is cut short; it patches `uvicorn.Server.handle_exit` at import and ends every
stream at the first SIGTERM unless disabled process-wide (the server drains them instead,
`--shutdown-timeout`); and its `send_timeout` ends a stalled response with `transport.close()`,
which keeps the socket until the buffer drains, i.e. forever for a client that never reads.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("kvserve.server")

T = TypeVar("T")
DONE_EVENT = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The HTTP client closed the connection before the response was complete."""


def sse_event(payload: dict[str, Any] | str) -> str:
    data = (
        payload
        if isinstance(payload, str)
        else json.dumps(payload, ensure_ascii=False, allow_nan=False)
    )
    return f"data: {data}\n\n"


def named_sse_event(name: str, payload: dict[str, Any]) -> str:
    """An event with an `event:` line (the Responses and Anthropic Messages streams name each event)."""
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (call only after the request body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel(*tasks: asyncio.Task[Any]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def run_until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it and raising ClientDisconnected if the client goes away first."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await _cancel(work_task, watch_task)
        raise
    if not work_task.done():
        await _cancel(work_task, watch_task)
        raise ClientDisconnected()
    await _cancel(watch_task)
    return work_task.result()


class SSEResponse(Response):
    """An ASGI response streaming `events` (already-encoded SSE strings).

    Unlike Starlette's StreamingResponse under ASGI spec 2.4 (which only notices a closed
    connection on the next write), this watches `receive` the whole time, so a client that
    leaves while its request is still queued or prefilling is noticed at once.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(
            {"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump_task = asyncio.ensure_future(self._pump(send, self.raw_headers))
        watch_task = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not pump_task.done():
                logger.debug("client disconnected mid-stream; aborting")
            await _cancel(pump_task, watch_task)
            await self.events.aclose()  # type: ignore[attr-defined]
            if pump_task.done() and not pump_task.cancelled() and pump_task.exception() is not None:
                logger.error("stream failed", exc_info=pump_task.exception())

    async def _pump(self, send: Send, raw_headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
        try:
            async for event in self.events:
                await send(
                    {"type": "http.response.body", "body": event.encode("utf-8"), "more_body": True}
                )
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (
            OSError
        ):  # uvicorn raises ClientDisconnected (an OSError) on a write to a closed socket
            logger.debug("client disconnected during write")
