"""SIGTERM drains a real `kvserve serve`: new requests and /health get 503 at once, requests in
flight finish, and those still open at `--shutdown-timeout` end with a clear error; exit 0."""

from __future__ import annotations

import json
import signal
import sys
import threading

import httpx
import pytest

from server_fixtures import ServerProcess
from test_engine_core import core_children, data_events, is_alive, wait_until

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory) -> str:
    """Context 4096, so one request can stream for far longer than the drain periods used here."""
    from checkpoints import make_checkpoint

    return make_checkpoint(
        tmp_path_factory.mktemp("shutdown") / "llama", "llama", max_position_embeddings=4096
    )


def completion(max_tokens: int, stream: bool) -> dict:
    return {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def running(url: str) -> float:
    from server_fixtures import metric, scrape

    return metric(scrape(url), "kvserve:num_requests_running")


def test_sigterm_lets_a_stream_finish_and_refuses_new_requests(long_checkpoint):
    # a drain period far longer than the stream needs on any machine, however loaded
    srv = ServerProcess(long_checkpoint, "--shutdown-timeout", "600").wait_ready()
    try:
        [core] = core_children(srv.proc.pid)
        with httpx.Client(timeout=120) as client:
            with client.stream(
                "POST", srv.url + "/v1/completions", json=completion(300, stream=True)
            ) as response:
                srv.proc.send_signal(
                    signal.SIGTERM
                )  # the stream is open: its first output has arrived
                health = client.get(srv.url + "/health")
                refused = client.post(srv.url + "/v1/completions", json=completion(1, stream=False))
                events = data_events(response.iter_lines())
        assert (
            health.status_code == 503 and health.json()["error"]["code"] == "server_shutting_down"
        )
        assert (
            refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        )
        assert refused.headers["retry-after"] == "5"
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        assert not any("error" in chunk for chunk in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        srv.proc.wait(30)
        assert srv.proc.returncode == 0, srv.log()[-3000:]
        assert "every request in flight finished" in srv.log()
        wait_until(lambda: not is_alive(core), 10, "the core to exit")
    finally:
        srv.stop()


def test_sigterm_ends_requests_still_open_at_the_deadline(long_checkpoint):
    srv = ServerProcess(long_checkpoint, "--shutdown-timeout", "0.5").wait_ready()
    try:
        [core] = core_children(srv.proc.pid)
        blocking: dict[str, httpx.Response] = {}
        thread = threading.Thread(
            target=lambda: blocking.setdefault(
                "response",
                httpx.post(
                    srv.url + "/v1/completions", json=completion(4000, stream=False), timeout=120
                ),
            )
        )
        thread.start()
        with httpx.Client(timeout=120) as client:
            with client.stream(
                "POST", srv.url + "/v1/completions", json=completion(4000, stream=True)
            ) as response:
                wait_until(lambda: running(srv.url) == 2, 60, "both requests to run")
                srv.proc.send_signal(signal.SIGTERM)
                events = data_events(response.iter_lines())
        thread.join(60)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
        num_tokens = sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in events[:-2])
        assert 0 < num_tokens < 4000
        cut = blocking["response"]
        assert cut.status_code == 503 and cut.json()["error"]["code"] == "server_shutting_down"
        srv.proc.wait(30)
        assert srv.proc.returncode == 0, srv.log()[-3000:]
        assert "shutdown timeout (0.5 s) reached" in srv.log()
        wait_until(lambda: not is_alive(core), 10, "the core to exit")
    finally:
        srv.stop()


if sys.platform != "linux":  # /proc is how these tests find the core process
    pytestmark = pytest.mark.skip("needs Linux /proc")
