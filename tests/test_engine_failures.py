"""Engine failures: steps that raise (injected into the runner with `KVSERVE_FAULT_STEPS`), the
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
from server_fixtures import ServerProcess

from engine import AsyncLLM, EngineArgs, EngineDeadError, LLMEngine, SamplingParams
from engine import async_llm, messages
from engine.core import FAULT_ENV, InjectedFault, inject_step_faults, parse_fault_steps
from engine.llm_engine import StepFailed

GREEDY = SamplingParams(temperature=0, max_tokens=1)


@pytest.mark.parametrize(("spec", "steps"), [("", None), ("3", (3, 3)), ("2-4", (2, 4)), (" 1+ ", (1, None))])
def test_parse_fault_steps(spec, steps):
    assert parse_fault_steps(spec) == steps


@pytest.mark.parametrize("spec", ["0", "x", "4-2", "-1", "1-", "+", "2-x"])
def test_parse_fault_steps_rejects(spec):
    with pytest.raises(ValueError, match=re.escape(repr(spec))):
        parse_fault_steps(spec)


def test_consecutive_failures_are_counted_and_reset(llama_dir):
    engine = LLMEngine(EngineArgs(model=llama_dir, dtype="float32", device="cpu", block_size=4))
    inject_step_faults(engine.runner, 2, 3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    num_free = engine.block_manager.num_free_blocks
    engine.add_request("a", [5, 6, 7], params)
    engine.step()                                # step 1 works
    assert engine.num_consecutive_step_failures == 0
    for num_failures, request_id in ((1, None), (2, "b")):   # steps 2 and 3 raise
        if request_id is not None:
            engine.add_request(request_id, [5, 6], params)
        with pytest.raises(StepFailed) as info:
            engine.step()
        assert isinstance(info.value.__cause__, InjectedFault)
        assert engine.num_consecutive_step_failures == num_failures
        assert engine.block_manager.num_free_blocks == num_free   # the failed requests' blocks are back
    engine.add_request("c", [5, 6], params)
    engine.step()                                # step 4 works again
    assert engine.num_consecutive_step_failures == 0


async def _collect(eng: AsyncLLM, request_id: str, params: SamplingParams = GREEDY) -> list:
    return [out async for out in eng.generate([5, 6, 7], params, request_id)]


def test_repeated_step_failures_kill_the_engine(llama_dir, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "2+")   # step 1 works, every later one raises
    eng = AsyncLLM(EngineArgs(model=llama_dir, dtype="float32", device="cpu"), max_consecutive_step_failures=2)

    async def run() -> None:
        assert (await _collect(eng, "ok"))[-1].finished
        with pytest.raises(RuntimeError, match="InjectedFault"):   # one failed step: only its request fails
            await _collect(eng, "first-failure")
        assert eng.is_healthy and eng.error is None
        with pytest.raises(RuntimeError, match="InjectedFault") as info:  # the second in a row: dead
            await _collect(eng, "second-failure")
        assert not isinstance(info.value, EngineDeadError)   # its own step's error, as before
        while eng.is_healthy:
            await asyncio.sleep(0.01)
        assert isinstance(eng.error, EngineDeadError) and "2 consecutive steps failed" in str(eng.error)
        with pytest.raises(EngineDeadError):
            await _collect(eng, "after")
        await eng.shutdown()

    asyncio.run(run())
    assert eng._process.exitcode == 1


def test_max_consecutive_step_failures_is_checked(llama_dir):
    with pytest.raises(ValueError, match="got 0"):
        AsyncLLM(EngineArgs(model=llama_dir, dtype="float32", device="cpu"), max_consecutive_step_failures=0)


def test_a_request_added_as_the_engine_dies_fails_at_once(llama_dir, monkeypatch):
    """The reader fails every open stream when the core dies; a request that registers just after
    that snapshot used to wait forever (its write still succeeded: the core had not exited yet)."""
    eng = AsyncLLM(EngineArgs(model=llama_dir, dtype="float32", device="cpu"))
    real_process_prompt = async_llm.process_prompt

    def process_prompt_while_the_core_dies(*args, **kwargs):
        os.kill(eng.core_pid, signal.SIGSTOP)   # alive, pipe open: a write succeeds, nothing answers
        eng._dispatch((messages.DEAD, "simulated death"))   # what the reader thread does on DEAD
        eng._fail_all(eng.error)
        return real_process_prompt(*args, **kwargs)

    monkeypatch.setattr(async_llm, "process_prompt", process_prompt_while_the_core_dies)

    async def run() -> None:
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_collect(eng, "late"), timeout=30)   # a hang guard, not a timing check

    try:
        asyncio.run(run())
    finally:
        os.kill(eng.core_pid, signal.SIGKILL)
        asyncio.run(eng.shutdown())


if sys.platform != "linux":
    pytestmark = pytest.mark.skip("needs Linux signals and /proc")
