"""Slow and hostile clients against a real `kvserve serve`: stalled readers, slowloris, connection floods.

Raw sockets play the hostile clients. Nothing here asserts on time: each test checks what the
server did (closed the socket, freed the seat, KV usage back to 0) with generous deadlines that
only stop a hang.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from kvserve.server.cli import build_parser, load_config, uvicorn_config
from kvserve.server.connections import RateLimitFilter
from server_fixtures import cached_server, metric, scrape, server_checkpoint, wait_idle  # noqa: F401

DEADLINE_S = 120.0  # only guards against hangs


@pytest.fixture(scope="module")
def stall_server(server_checkpoint):
    """Eight seats, no queue, short stalled-reader and header timeouts."""
    srv = cached_server(
        "hostile-stall",
        server_checkpoint,
        "--max-num-seqs",
        "8",
        "--max-queue",
        "0",
        "--stream-idle-timeout",
        "1",
        "--header-timeout",
        "1",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def capped_server(server_checkpoint):
    """At most 8 connections, header timeout off (so idle sockets stay until the test closes them)."""
    srv = cached_server(
        "hostile-capped", server_checkpoint, "--max-connections", "8", "--header-timeout", "0"
    )
    yield srv
    srv.stop()


def _connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf
        )  # before connect: sets the TCP window
    sock.connect(("127.0.0.1", port))
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sent until it closed the connection (FIN or RST)."""
    sock.settimeout(DEADLINE_S)
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _post(url: str, path: str = "/v1/completions", **body) -> httpx.Response:
    return httpx.post(
        url + path, json={"prompt": "hi", "max_tokens": 2, **body}, timeout=DEADLINE_S
    )


def test_stalled_reader_is_aborted_and_its_seat_freed(stall_server):
    """A stream whose client stops reading must not hold its seats (503 for everyone else) forever."""
    # n=8 takes every seat. Chat logprobs make ~1.5 KB per token and sequence: ~7 MB in all, more than
    # the client's small window plus the kernel's send buffer plus uvicorn's, so the server must stall.
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 600,
            "ignore_eos": True,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 20,
            "n": 8,
        }
    ).encode()
    stalled = _connect(stall_server.port, rcvbuf=4096)
    stalled.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    deadline = time.monotonic() + DEADLINE_S
    while (
        metric(scrape(stall_server.url), "kvserve:num_requests_running") < 8
    ):  # it holds every seat
        assert time.monotonic() < deadline
        time.sleep(0.05)
    statuses = []
    while (
        time.monotonic() < deadline
    ):  # 503 (no free seat, --max-queue 0) until the stalled stream is cut
        statuses.append(_post(stall_server.url).status_code)
        if statuses[-1] == 200:
            break
        time.sleep(0.2)
    assert statuses[-1] == 200 and set(statuses) <= {200, 503}, statuses
    received = _read_until_closed(stalled)
    stalled.close()
    assert (
        received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
    )  # cut, not finished
    wait_idle(stall_server.url)  # no running or waiting sequence, no KV block in use
    assert "--stream-idle-timeout" in stall_server.log()


def test_slowloris_sockets_are_closed(stall_server):
    """100 sockets that send a partial header and trickle more are closed; /health answers meanwhile."""
    socks = [_connect(stall_server.port) for _ in range(100)]
    for sock in socks:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
        sock.setblocking(False)
    open_socks = set(socks)
    num_rounds = 0
    deadline = time.monotonic() + DEADLINE_S
    while open_socks and time.monotonic() < deadline:
        for sock in list(open_socks):
            try:
                if sock.recv(1024) == b"":
                    open_socks.discard(sock)
                    continue
            except BlockingIOError:
                pass
            except ConnectionResetError:
                open_socks.discard(sock)
                continue
            try:
                sock.send(
                    b"X-Slow: %d\r\n" % num_rounds
                )  # one more header line, never the blank one
            except (BrokenPipeError, ConnectionResetError):
                open_socks.discard(sock)
        if num_rounds == 0:
            assert httpx.get(stall_server.url + "/health", timeout=DEADLINE_S).status_code == 200
        num_rounds += 1
        time.sleep(0.2)
    for sock in socks:
        sock.close()
    assert not open_socks, f"{len(open_socks)} of 100 slowloris sockets still open"
    assert num_rounds > 1  # they trickled before being closed
    assert httpx.get(stall_server.url + "/health", timeout=DEADLINE_S).status_code == 200


def test_kept_alive_connection_gets_a_header_timeout_too(stall_server):
    sock = _connect(stall_server.port)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    sock.settimeout(DEADLINE_S)
    first = b""
    while not first.endswith(
        b'{"status":"ok"}'
    ):  # the whole first response (it may come in pieces)
        chunk = sock.recv(1 << 16)
        assert chunk, first
        first += chunk
    assert first.startswith(b"HTTP/1.1 200")
    sock.sendall(
        b"GET /health HTTP/1.1\r\nHost: t\r\n"
    )  # the next request never completes its headers
    assert _read_until_closed(sock) == b""
    sock.close()


def _is_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        sock.setblocking(True)


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:  # the server notices closed sockets shortly
        try:
            if httpx.get(url + "/health", timeout=DEADLINE_S).status_code == 200:
                return
        except httpx.TransportError:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_connection_cap_evicts_the_oldest_idle_connection(capped_server):
    """At the cap a new connection gets in by closing the one idle longest (slowloris sockets churn out)."""
    idle = [_connect(capped_server.port) for _ in range(8)]  # never send a byte
    newcomer = _connect(capped_server.port)
    newcomer.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert _read_until_closed(newcomer).startswith(b"HTTP/1.1 200")
    newcomer.close()
    assert _read_until_closed(idle[0]) == b""  # the oldest was closed to make room
    assert all(_is_open(sock) for sock in idle[2:])
    for sock in idle:
        sock.close()
    assert "closing the oldest idle connections" in capped_server.log()
    _wait_healthy(capped_server.url)


def test_connection_cap_refuses_when_every_connection_is_busy(capped_server):
    """Connections with a request in progress are never evicted: beyond the cap, new ones are closed."""
    _wait_healthy(capped_server.url)
    busy = [_connect(capped_server.port) for _ in range(8)]
    for sock in busy:  # complete headers, body never sent: the request is in progress
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10\r\nExpect: 100-continue\r\n\r\n"
        )
    for sock in busy:  # the server asks for the body once the handler reads it: it is busy now
        sock.settimeout(DEADLINE_S)
        assert sock.recv(1024).startswith(b"HTTP/1.1 100")
    extra = _connect(capped_server.port)
    try:
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert _read_until_closed(extra) == b""  # closed without an answer
    extra.close()
    assert all(_is_open(sock) for sock in busy)
    for sock in busy:
        sock.close()
    assert "every connection is busy" in capped_server.log()
    _wait_healthy(capped_server.url)


# --------------------------------------------------------------------------- no server


def test_flags_reach_uvicorn(monkeypatch):
    monkeypatch.setenv("KVSERVE_HEADER_TIMEOUT", "3")
    config = load_config(
        build_parser().parse_args(
            [
                "serve",
                "--keep-alive-timeout",
                "7",
                "--stream-idle-timeout",
                "0",
                "--max-connections",
                "50",
            ]
        )
    )
    uv_config = uvicorn_config(object(), config)
    assert uv_config.timeout_keep_alive == 7
    limits = uv_config.http.limits
    assert (limits.header_timeout_s, limits.stream_idle_timeout_s, limits.max_connections) == (
        3,
        0,
        50,
    )
    monkeypatch.delenv("KVSERVE_HEADER_TIMEOUT")
    defaults = load_config(build_parser().parse_args(["serve"]))
    assert (defaults.header_timeout, defaults.stream_idle_timeout, defaults.keep_alive_timeout) == (
        10,
        60,
        5,
    )
    assert (
        uvicorn_config(object(), defaults).http.limits.max_connections >= 16
    )  # from the open-file limit
    with pytest.raises(ValueError, match="--header-timeout"):
        load_config(build_parser().parse_args(["serve", "--header-timeout", "-1"]))


def test_rate_limit_filter_counts_suppressed_lines():
    now = [100.0]
    flood = RateLimitFilter(("out of system resource",), interval_s=10, clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, (), None)

    assert flood.filter(record("socket.accept() out of system resource"))
    assert [flood.filter(record("socket.accept() out of system resource")) for _ in range(500)] == [
        False
    ] * 500
    assert flood.filter(record("something else"))
    now[0] += 11
    passed = record("socket.accept() out of system resource")
    assert flood.filter(passed) and "500 similar lines suppressed" in passed.getMessage()


class _FakeTransport:
    """Just enough of an asyncio transport for the protocol's timers."""

    def __init__(self) -> None:
        self.num_buffered_bytes = 0
        self.is_aborted = self._is_closing = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default
        )

    def get_write_buffer_size(self) -> int:
        return self.num_buffered_bytes

    def abort(self) -> None:
        self.is_aborted = self._is_closing = True

    def close(self) -> None:
        self._is_closing = True

    def is_closing(self) -> bool:
        return self._is_closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_a_reader_that_reads_something_is_not_cut():
    """The stall timer restarts while what is queued for the client shrinks; it cuts only a
    reader that reads nothing."""
    import asyncio

    import uvicorn
    from uvicorn.server import ServerState

    from kvserve.server.connections import ConnectionLimits, protocol_class

    loop = asyncio.new_event_loop()
    try:
        limits = ConnectionLimits(
            header_timeout_s=10, stream_idle_timeout_s=60, max_connections=None
        )
        proto = protocol_class(limits)(
            config=uvicorn.Config(lambda *a: None),
            server_state=ServerState(),
            app_state={},
            _loop=loop,
        )
        transport = _FakeTransport()
        proto.connection_made(transport)
        transport.num_buffered_bytes = 100_000
        proto.pause_writing()
        for num_bytes in (90_000, 1_000, 999):  # the client reads a little each period
            transport.num_buffered_bytes = num_bytes
            proto._write_timer.cancel()
            proto._on_write_stalled()  # what the timer does when it fires
            assert not transport.is_aborted and proto._write_timer is not None
        proto._write_timer.cancel()
        proto._on_write_stalled()  # nothing read in a whole period
        assert transport.is_aborted and proto.counts["stalled"] == 1
    finally:
        loop.close()
