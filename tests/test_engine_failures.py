"""Engine failures: steps that raise (a `FaultyExecutor` test double wraps the engine's executor), the
core declaring itself dead after repeated failures, the server exiting (or staying up with
`--keep-alive-on-engine-death`), a request racing the death, and error bodies that keep
internal exception text in the log."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys

import httpx
import pytest

from faulty_executor import (
    FaultyExecutor,
    InjectedFault,
    fault_server_launcher,
    faults,
    parse_fault_steps,
)
from kvserve.engine import (
    AsyncLLM,
    EngineArgs,
    EngineDeadError,
    LLMEngine,
    SamplingParams,
    async_llm,
    messages,
)
from kvserve.engine.errors import StepFailed
from kvserve.engine.worker.executor_protocol import Executor
from server_fixtures import ServerProcess
from test_engine_core import core_children, is_alive, wait_until

GREEDY = SamplingParams(temperature=0, max_tokens=1)


@pytest.mark.parametrize(
    ("spec", "steps"), [("", None), ("3", (3, 3)), ("2-4", (2, 4)), (" 1+ ", (1, None))]
)
def test_parse_fault_steps(spec, steps):
    assert parse_fault_steps(spec) == steps


@pytest.mark.parametrize("spec", ["0", "x", "4-2", "-1", "1-", "+", "2-x"])
def test_parse_fault_steps_rejects(spec):
    with pytest.raises(ValueError, match=re.escape(repr(spec))):
        parse_fault_steps(spec)


def test_executors_write_out_every_member_of_the_protocol():
    from kvserve.engine.worker.executor import TensorParallelExecutor

    members = [name for name in vars(Executor) if not name.startswith("_")]
    assert {"execute", "warm_up", "dead_reason", "shutdown", "num_kv_blocks"} <= set(members)
    for cls in (
        TensorParallelExecutor,
        FaultyExecutor,
    ):  # (ModelRunner sets some in __init__: below)
        assert "__getattr__" not in vars(cls) and all(name in vars(cls) for name in members), cls


def test_consecutive_failures_are_counted_and_reset(llama_dir):
    engine = LLMEngine(EngineArgs(model=llama_dir, dtype="float32", device="cpu", block_size=4))
    assert isinstance(engine.runner, Executor) and engine.runner.dead_reason is None
    engine.runner = FaultyExecutor(engine.runner, first=2, last=3)
    assert isinstance(engine.runner, Executor)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    num_free = engine.kv_cache_manager.num_free_blocks
    engine.add_request("a", [5, 6, 7], params)
    engine.step()  # step 1 works
    assert engine.num_consecutive_step_failures == 0
    for num_failures, request_id in ((1, None), (2, "b")):  # steps 2 and 3 raise
        if request_id is not None:
            engine.add_request(request_id, [5, 6], params)
        with pytest.raises(StepFailed) as info:
            engine.step()
        assert isinstance(info.value.__cause__, InjectedFault)
        assert engine.num_consecutive_step_failures == num_failures
        assert (
            engine.kv_cache_manager.num_free_blocks == num_free
        )  # the failed requests' blocks are back
    engine.add_request("c", [5, 6], params)
    engine.step()  # step 4 works again
    assert engine.num_consecutive_step_failures == 0


async def _collect(eng: AsyncLLM, request_id: str, params: SamplingParams = GREEDY) -> list:
    return [out async for out in eng.generate([5, 6, 7], params, request_id)]


def test_repeated_step_failures_kill_the_engine(llama_dir):
    eng = AsyncLLM(
        EngineArgs(model=llama_dir, dtype="float32", device="cpu", max_consecutive_step_failures=2),
        executor_wrapper=faults("2+"),
    )  # step 1 works, every later one raises

    async def run() -> None:
        assert (await _collect(eng, "ok"))[-1].finished
        with pytest.raises(
            RuntimeError, match="InjectedFault"
        ):  # one failed step: only its request fails
            await _collect(eng, "first-failure")
        assert eng.is_healthy and eng.error is None
        with pytest.raises(
            RuntimeError, match="InjectedFault"
        ) as info:  # the second in a row: dead
            await _collect(eng, "second-failure")
        assert not isinstance(info.value, EngineDeadError)  # its own step's error, as before
        while eng.is_healthy:
            await asyncio.sleep(0.01)
        assert isinstance(eng.error, EngineDeadError) and "2 consecutive steps failed" in str(
            eng.error
        )
        with pytest.raises(EngineDeadError):
            await _collect(eng, "after")
        await eng.shutdown()

    asyncio.run(run())
    assert eng._process.exitcode == 1


def test_max_consecutive_step_failures_is_checked(llama_dir):
    with pytest.raises(
        ValueError, match="max_consecutive_step_failures must be a positive integer, got 0"
    ):
        AsyncLLM(
            EngineArgs(
                model=llama_dir, dtype="float32", device="cpu", max_consecutive_step_failures=0
            )
        )


def test_a_request_added_as_the_engine_dies_fails_at_once(llama_dir, monkeypatch):
    """The reader fails every open stream when the core dies; a request that registers just after
    that snapshot used to wait forever (its write still succeeded: the core had not exited yet)."""
    eng = AsyncLLM(EngineArgs(model=llama_dir, dtype="float32", device="cpu"))
    real_process_prompt = async_llm.process_prompt

    def process_prompt_while_the_core_dies(*args, **kwargs):
        os.kill(eng.core_pid, signal.SIGSTOP)  # alive, pipe open: a write succeeds, nothing answers
        eng._dispatch(messages.Dead("simulated death"))  # what the reader thread does on Dead
        eng._fail_all(eng.error)
        return real_process_prompt(*args, **kwargs)

    monkeypatch.setattr(async_llm, "process_prompt", process_prompt_while_the_core_dies)

    async def run() -> None:
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(
                _collect(eng, "late"), timeout=30
            )  # a hang guard, not a timing check

    try:
        asyncio.run(run())
    finally:
        os.kill(eng.core_pid, signal.SIGKILL)
        asyncio.run(eng.shutdown())


# --------------------------------------------------------------------------- a real server


def post(url: str, max_tokens: int = 1, stream: bool = False) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={
            "prompt": [5, 6, 7],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": stream,
        },
    )


def logged_near(log: str, request_id: str, text: str) -> bool:
    """`text` is in the log entry (a line and its traceback) that names `request_id`."""
    start = log.find(request_id)
    return start >= 0 and text in log[start : start + 5000]


def assert_hides_internals(error: dict) -> None:
    for secret in ("InjectedFault", "injected fault", "EngineDied", "consecutive", "Traceback"):
        assert secret not in error["message"], error


def test_server_exits_1_after_repeated_step_failures(server_checkpoint):
    srv = ServerProcess(
        server_checkpoint,
        "--max-consecutive-step-failures",
        "2",
        launcher=fault_server_launcher("1+"),
    )
    srv.wait_ready()
    try:
        [core] = core_children(srv.proc.pid)
        first = post(srv.url)
        assert first.status_code == 500 and first.json()["error"]["code"] == "internal_error"
        assert (
            httpx.get(srv.url + "/health", timeout=10).status_code == 200
        )  # one failed step: it goes on
        assert post(srv.url).status_code == 500  # the second in a row
        srv.proc.wait(30)
        assert srv.proc.returncode == 1
        assert "the engine is dead; shutting the server down" in srv.log()
        wait_until(lambda: not is_alive(core), 10, "the core to exit")
    finally:
        srv.stop()


def test_error_bodies_name_a_request_id_not_the_exception(server_checkpoint):
    """Also `--keep-alive-on-engine-death`: the dead engine's server stays up, answering 503."""
    srv = ServerProcess(
        server_checkpoint,
        "--max-consecutive-step-failures",
        "2",
        "--keep-alive-on-engine-death",
        launcher=fault_server_launcher("3+"),
    ).wait_ready()
    try:
        stream = post(
            srv.url, max_tokens=5, stream=True
        )  # steps 1 and 2 work, step 3 raises mid-stream
        events = [
            json.loads(line[6:])
            for line in stream.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        assert stream.text.rstrip().endswith("data: [DONE]")
        request_id, error = events[0]["id"], events[-1]["error"]
        assert error["code"] == "internal_error" and request_id in error["message"]
        assert_hides_internals(error)
        assert logged_near(srv.log(), f"request {request_id} failed", "InjectedFault")

        failed = post(srv.url)  # step 4 raises: the second failure in a row kills the engine
        request_id, error = failed.headers["x-request-id"], failed.json()["error"]
        assert failed.status_code == 500 and request_id in error["message"]
        assert_hides_internals(error)
        assert logged_near(srv.log(), f"request {request_id} failed", "InjectedFault")

        wait_until(
            lambda: httpx.get(srv.url + "/health", timeout=10).status_code == 503, 30, "/health 503"
        )
        dead = post(srv.url)
        request_id, error = dead.headers["x-request-id"], dead.json()["error"]
        assert (
            dead.status_code == 503
            and error["code"] == "engine_dead"
            and request_id in error["message"]
        )
        assert_hides_internals(error)
        assert logged_near(
            srv.log(),
            f"request {request_id} failed: the engine is dead",
            "consecutive steps failed",
        )
        assert srv.proc.poll() is None  # kept alive
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(30)
        assert srv.proc.returncode == 1  # the engine died
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server_checkpoint(tmp_path_factory):
    from server_fixtures import cached_checkpoint

    return cached_checkpoint(tmp_path_factory)


def test_unhandled_errors_name_a_request_id_not_the_exception(caplog):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kvserve.server.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internal detail")

    with caplog.at_level("ERROR", logger="kvserve.server"):
        resp = TestClient(app, raise_server_exceptions=False).get("/boom")
    error, request_id = resp.json()["error"], resp.headers["x-request-id"]
    assert (
        resp.status_code == 500
        and error["code"] == "internal_error"
        and request_id in error["message"]
    )
    assert "secret" not in resp.text
    [record] = [r for r in caplog.records if request_id in r.getMessage()]
    assert "secret internal detail" in str(record.exc_info[1])


if sys.platform != "linux":
    pytestmark = pytest.mark.skip("needs Linux signals and /proc")
