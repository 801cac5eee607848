"""Connection-level defences for uvicorn: header timeout, stalled-reader timeout, connection cap.

uvicorn has a keep-alive timeout and `limit_concurrency`, but nothing closes a connection
that never finishes its request headers (slowloris), nothing bounds how long a response
may wait for a client that stopped reading, and `limit_concurrency` answers 503 only once
headers are complete, so idle sockets still pile up until `accept()` fails with EMFILE.
`HardenedHttpToolsProtocol` adds the three on top of uvicorn's httptools protocol:

- **header timeout**: a timer starts when a connection opens (and when the next request on
  a kept-alive connection begins) and is cancelled when the request's headers are complete;
  if it fires, the connection is closed.
- **stalled reader**: the transport calls `pause_writing` when its write buffer is over the
  high-water mark (the client's receive window and the kernel's send buffer are full), and
  uvicorn's `send` then waits. While paused nothing new is queued, so what is queued for the
  client (the transport's buffer plus, on Linux, the kernel's send queue) shrinks only when the
  client reads. If it has not shrunk for `stream_idle_timeout_s`, the connection is aborted
  (RST: `close()` would wait for the buffer to drain, which never happens). uvicorn then
  reports `http.disconnect`, so the handler aborts the engine requests and frees the seat. A
  client that reads anything in that time gets another period.
- **connection cap**: at most `max_connections` stay open, so `accept()` never runs out of
  file descriptors. When a new one would exceed the cap, the oldest *idle* connection (one
  that has not completed its request headers, or a kept-alive one between requests) is closed
  to make room: slowloris sockets are churned out while clients that send their headers at
  once get in. When every open connection has a request in progress, the new one is closed
  instead (docs/server.md compares this with uvicorn's `limit_concurrency`).

`RateLimitFilter` keeps floods of identical log lines (`accept() out of system resource`,
refused connections) to one line per interval with a count of those suppressed.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

try:  # SIOCOUTQ (= TIOCOUTQ on Linux): bytes in a TCP socket's send queue not yet acknowledged
    import fcntl
    import termios

    _TIOCOUTQ: int | None = termios.TIOCOUTQ
except (ImportError, AttributeError):  # not POSIX: only the transport's buffer is watched
    _TIOCOUTQ = None

logger = logging.getLogger("kvserve.server")

# The fds the server needs besides client connections (listening socket, engine pipe, epoll,
# tokenizer and model files, log files, the health checker's own connections...).
FD_RESERVE = 128


def default_max_connections() -> int:
    """The open-file soft limit minus `FD_RESERVE` (at least 16), so `accept()` never hits EMFILE."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(16, soft - FD_RESERVE)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """Per-connection limits; 0 (or None for `max_connections`) turns a limit off."""

    header_timeout_s: float
    stream_idle_timeout_s: float
    max_connections: int | None

    def __post_init__(self) -> None:
        if self.header_timeout_s < 0 or self.stream_idle_timeout_s < 0:
            raise ValueError(
                f"timeouts must be >= 0, got header_timeout_s={self.header_timeout_s!r}, "
                f"stream_idle_timeout_s={self.stream_idle_timeout_s!r}"
            )
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections!r}")


class HardenedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus the limits in `limits` (set on a subclass by `protocol_class`)."""

    limits = ConnectionLimits(header_timeout_s=0, stream_idle_timeout_s=0, max_connections=None)
    # Connections without a request in progress, oldest first (a dict keeps insertion order);
    # `protocol_class` gives each server its own.
    idle: dict[HardenedHttpToolsProtocol, None] = {}
    counts = {"evicted": 0, "refused": 0, "header_timeouts": 0, "stalled": 0}

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._num_buffered_bytes = (
            0  # bytes queued for the client when the stall timer was (re)armed
        )
        super().connection_made(transport)
        cap = self.limits.max_connections
        if cap is not None and len(self.connections) > cap and not self._evict_oldest_idle():
            self.counts["refused"] += 1
            logger.warning(
                "connection limit (--max-connections %d) reached and every connection is busy: "
                "closing new connections",
                cap,
            )
            transport.abort()
            return
        self.idle[self] = None
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        self.idle.pop(self, None)
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()  # the next request on a kept-alive connection gets the same bound

    def on_headers_complete(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self.idle.pop(self, None)
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline:
            self.idle[self] = None  # kept alive, waiting for the next request: the newest idle one

    def _evict_oldest_idle(self) -> bool:
        """Close the connection that has been idle longest to make room; False when none is idle."""
        while self.idle:
            oldest = next(iter(self.idle))
            del self.idle[oldest]
            if not oldest.transport.is_closing():
                self.counts["evicted"] += 1
                logger.warning(
                    "connection limit (--max-connections %d) reached: closing the oldest idle "
                    "connections",
                    self.limits.max_connections,
                )
                oldest.transport.abort()
                return True
        return False

    def pause_writing(self) -> None:
        super().pause_writing()
        timeout = self.limits.stream_idle_timeout_s
        if timeout > 0 and self._write_timer is None:
            self._num_buffered_bytes = self._num_queued_bytes()
            self._write_timer = self.loop.call_later(timeout, self._on_write_stalled)

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()

    def _num_queued_bytes(self) -> int:
        """Bytes written but not yet acknowledged by the client: the transport's buffer plus the kernel's queue.

        The kernel's part matters: a client that reads slowly frees kernel buffer space long
        before the socket counts as writable again (Linux waits for a third of it), so the
        transport's buffer alone would look stalled.
        """
        num_bytes = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None and _TIOCOUTQ is not None:
            try:
                num_bytes += struct.unpack("i", fcntl.ioctl(sock.fileno(), _TIOCOUTQ, b"\0\0\0\0"))[
                    0
                ]
            except OSError:
                pass
        return num_bytes

    def _arm_header_timer(self) -> None:
        timeout = self.limits.header_timeout_s
        if timeout > 0 and self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(timeout, self._on_header_timeout)

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._write_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        self.counts["header_timeouts"] += 1
        logger.debug(
            "%s: no complete request headers in %.1f s; closing",
            self.client,
            self.limits.header_timeout_s,
        )
        self.transport.close()  # nothing was written, so this closes at once (FIN: the client reads b"")

    def _on_write_stalled(self) -> None:
        self._write_timer = None
        num_buffered_bytes = self._num_queued_bytes()
        if num_buffered_bytes < self._num_buffered_bytes:  # the client read something: not stalled
            self._num_buffered_bytes = num_buffered_bytes
            self._write_timer = self.loop.call_later(
                self.limits.stream_idle_timeout_s, self._on_write_stalled
            )
            return
        self.counts["stalled"] += 1
        logger.info(
            "%s: client read nothing for %.1f s (--stream-idle-timeout); closing and aborting its request",
            self.client,
            self.limits.stream_idle_timeout_s,
        )
        self.transport.abort()


def protocol_class(limits: ConnectionLimits) -> type[HardenedHttpToolsProtocol]:
    """A protocol class for `uvicorn.Config(http=...)` bound to `limits`."""
    return type(
        "KVServeHttpProtocol",
        (HardenedHttpToolsProtocol,),
        {
            "limits": limits,
            "idle": {},
            "counts": dict.fromkeys(HardenedHttpToolsProtocol.counts, 0),
        },
    )


class RateLimitFilter(logging.Filter):
    """Let a record whose message contains one of `patterns` through once per `interval_s`.

    The next one let through says how many were suppressed since. Other records pass.
    """

    def __init__(
        self,
        patterns: tuple[str, ...],
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.patterns = patterns
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._num_suppressed: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        pattern = next((p for p in self.patterns if p in message), None)
        if pattern is None:
            return True
        now = self.clock()
        last = self._last.get(pattern)
        if last is not None and now - last < self.interval_s:
            self._num_suppressed[pattern] = self._num_suppressed.get(pattern, 0) + 1
            return False
        self._last[pattern] = now
        num_suppressed = self._num_suppressed.pop(pattern, 0)
        if num_suppressed and last is not None:  # counted only after a first line
            record.msg = f"{message} ({num_suppressed} similar lines suppressed in the last {now - last:.0f} s)"
            record.args = ()
        if record.exc_info and last is not None:
            record.exc_info = None  # the traceback is the same every time; keep the first one
            record.exc_text = None
        return True


FLOOD_PATTERNS = (
    "out of system resource",
    "Too many open files",
    "every connection is busy",
    "closing the oldest idle",
    "Exceeded concurrency limit",
    "Invalid HTTP request received",
)


def install_log_rate_limits(interval_s: float = 10.0) -> RateLimitFilter:
    """Attach one `RateLimitFilter` for connection floods to the loggers that report them (once per process)."""
    global _flood_filter
    if _flood_filter is None:
        _flood_filter = RateLimitFilter(FLOOD_PATTERNS, interval_s)
        for name in ("asyncio", "uvicorn.error", "kvserve.server"):
            logging.getLogger(name).addFilter(_flood_filter)
    return _flood_filter


_flood_filter: RateLimitFilter | None = None
