"""Graceful shutdown: on SIGTERM/SIGINT, drain in-flight requests for `--shutdown-timeout` seconds.

The drain stops admitting at once (new requests and `/health` answer 503, so load balancers
take the instance out) but keeps the listening socket open, lets the requests in flight
finish, and at the deadline shuts the engine down, which ends every stream still open with
a `server_shutting_down` error event (then `[DONE]`) and every non-streaming request with a
503. Only then does uvicorn stop. A second signal skips the rest of the drain.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvserve.server.app import AppState
    from kvserve.server.serving import Admission

logger = logging.getLogger("kvserve.server")

_POLL_S = 0.05
_CUT_GRACE_S = 5.0  # after the deadline, how long the cut requests may take to send their error


async def drain(state: AppState, timeout_s: float) -> None:
    """Refuse new requests, wait up to `timeout_s` for those in flight, then cut the rest."""
    admission = state.admission
    admission.close()
    loop = asyncio.get_running_loop()
    logger.info(
        "shutting down: refusing new requests; %d sequences in flight, waiting up to %.1f s for them",
        admission.num_in_flight,
        timeout_s,
    )
    await _until_idle(admission, loop.time() + timeout_s)
    if admission.num_in_flight:
        logger.warning(
            "shutdown timeout (%.1f s) reached: ending %d sequences still in flight with an error",
            timeout_s,
            admission.num_in_flight,
        )
        await state.engine.shutdown()  # open streams end with EngineShutDownError
        await _until_idle(admission, loop.time() + _CUT_GRACE_S)
    else:
        logger.info("every request in flight finished")


async def _until_idle(admission: Admission, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    while admission.num_in_flight and loop.time() < deadline:
        await asyncio.sleep(_POLL_S)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the app (`drain`) before it stops.

    Exits without re-raising the signal, so `kvserve serve` returns 0 after a drain.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._is_draining = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = getattr(self.app.state, "kv", None)
        if self._is_draining or state is None or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal, or not serving yet: stop now
            return
        self._is_draining = True
        logger.info("received %s", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain, state)

    def _start_drain(self, state: AppState) -> None:
        self._drain_task = asyncio.ensure_future(drain(state, self.shutdown_timeout_s))
        self._drain_task.add_done_callback(self._drained)

    def _drained(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("the drain failed", exc_info=task.exception())
        self.should_exit = True
