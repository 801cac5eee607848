"""The engine core in its own process: the message codec, outputs across the boundary, and
what happens when either process dies or is signalled."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from kvserve.engine import LLM, AsyncLLM, EngineArgs, EngineDeadError, SamplingParams, messages
from kvserve.engine.config import RuntimeInfo
from kvserve.engine.core.step_record import NewRequestData, SamplingInputs, StepRecord
from kvserve.engine.input_processor import ProcessedPrompt
from kvserve.engine.outputs import (
    CompletionDelta,
    EngineStats,
    Logprob,
    RequestDelta,
    RequestMetrics,
)
from kvserve.engine.sampling_params import StructuredOutputs
from server_fixtures import ServerProcess


def core_children(pid: int) -> list[int]:
    """Live child processes of `pid` that are multiprocessing spawns (the engine core)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z" and "spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


# --------------------------------------------------------------------------- codec


def _every_field_set(cls, **values):
    """An instance of struct `cls` in which every field not given holds a value of its own (no defaults)."""
    for i, field in enumerate(msgspec.structs.fields(cls)):
        if field.name not in values:
            values[field.name] = i + 0.25 if "float" in str(field.type) else i + 1
    return cls(**values)


def _one_of_each_message() -> list:
    entry = {7: Logprob(-0.5, 1, "a"), 9: Logprob(-2.25, 3, "\u00e9\u6771")}
    delta = RequestDelta(
        request_id="r-0",
        outputs=[
            CompletionDelta(0, "h\u00e9", [7, 9], [entry, entry], -2.75, "stop", "</s>"),
            CompletionDelta(1, "", [3], None, None, "length", None),
            CompletionDelta(2, "x", [4], [entry], -0.5, None, 11),
        ],
        finished=False,
        metrics=RequestMetrics(1.0, 1.5, 2.0, 2.5, None),
        num_cached_tokens=16,
        prompt_logprobs=[None, entry],
    )
    stats = _every_field_set(EngineStats, kv_cache_usage=0.5)
    params = SamplingParams(
        n=2,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        max_tokens=7,
        min_tokens=1,
        stop=["x"],
        stop_token_ids=[4],
        seed=3,
        logprobs=2,
        prompt_logprobs=1,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.3,
        logit_bias={5: 1.5},
        structured_outputs=StructuredOutputs(json={"type": "object"}),
    )
    prompt = ProcessedPrompt(
        prompt="hi",
        prompt_token_ids=[1, 2, 3],
        params=params,
        max_tokens=7,
        cache_salt="tenant-a",
        priority=2,
    )
    info = RuntimeInfo(
        model_path="/m",
        architecture="LlamaForCausalLM",
        dtype="bfloat16",
        device="cpu",
        vocab_size=100,
        max_model_len=64,
        eos_token_ids=(0, 2),
        num_kv_blocks=9,
        block_size=4,
        attention_backend="cpu",
        cuda_graphs=True,
        tensor_parallel_size=2,
        decoder_start_token_id=3,
    )
    sampling = SamplingInputs(
        temperature=0.5,
        top_k=5,
        top_p=0.9,
        min_p=0.1,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.3,
        seed=3,
        min_tokens=1,
        suppressed_token_ids=(0, 2),
        num_logprobs=2,
        num_prompt_logprobs=1,
        logit_bias=((5, 1.5),),
    )
    new = NewRequestData(
        req_id="r-0#0",
        prompt_token_ids=(1, 2, 3),
        output_token_ids=(4,),
        block_ids=(1, 2),
        sampling=sampling,
        cross_block_ids=(3,),
        cross_len=2,
        encoder_token_ids=(7, 8),
    )
    record = StepRecord(
        finished_req_ids=("f",),
        preempted_req_ids=("p",),
        new_requests=(new,),
        req_ids=("r-0#0", "r-1#0"),
        num_computed_tokens=(0, 5),
        num_scheduled_tokens=(3, 1),
        new_block_ids={"r-1#0": (6,)},
        spec_token_ids={"r-1#0": (9, 10)},
        block_copies=((1, 2, 3),),
    )
    return [
        messages.AddRequest("r-0", prompt, 12.5),
        messages.AbortRequest("r-0"),
        messages.Stop(),
        messages.Ready(info, stats),
        messages.StartFailed(
            error_type="builtins.ValueError", message="bad checkpoint", traceback="Traceback ..."
        ),
        messages.StepOutputs([delta], stats),
        messages.Stats(stats),
        messages.Rejected("r-0", "structured_outputs.regex is empty"),
        messages.Overloaded("r-0", "the grammar compile queue is full"),
        messages.StepFailedRequests(["r-0", "r-1"], "internal error", stats),
        messages.Dead("engine loop died"),
        messages.WorkerStep(record, (5, None), (1, 0)),
        messages.WorkerLoaded(),
        messages.WorkerAddLoRA(3, "sql", "/adapters/sql"),
        messages.WorkerRemoveLoRA(3),
        messages.WorkerLoRAResult("lora_A shapes"),
    ]


def test_codec_round_trips_every_message_and_field():
    sent = _one_of_each_message()
    assert {type(m) for m in sent} == set(
        messages.MESSAGE_TYPES
    )  # a new message type needs a case here
    assert len({type(m).__struct_config__.tag for m in sent}) == len(sent)
    for message in sent:
        assert messages.decode(messages.encode(message)) == message


class _NotAnError:  # a type the receiving side must never import
    pass


@pytest.mark.parametrize(
    ("error", "expected_type", "text"),
    [
        (ValueError("bad"), ValueError, "bad"),
        (FileNotFoundError("no such file"), FileNotFoundError, "no such file"),
        (EngineDeadError("gone"), EngineDeadError, "gone"),
        (
            json.JSONDecodeError("Expecting value", "x", 0),
            RuntimeError,
            "JSONDecodeError: Expecting value",
        ),
    ],
)
def test_start_failed_carries_an_error_as_text(error, expected_type, text):
    try:
        raise error
    except Exception as e:  # (a traceback to carry)
        sent = messages.StartFailed.from_exception(e)
    received = messages.decode(messages.encode(sent))
    assert received == sent and "Traceback" in received.traceback
    raised = received.to_exception()
    assert type(raised) is expected_type and text in str(raised)
    assert any("raised in the engine process" in note for note in raised.__notes__)
    odd = messages.StartFailed(error_type=f"{__name__}._NotAnError", message="x").to_exception()
    assert type(odd) is RuntimeError and str(odd) == "_NotAnError: x"


@pytest.mark.parametrize(
    "frame",
    [
        pickle.dumps(("step", [], None)),  # not MessagePack
        msgspec.msgpack.encode(("step", [], None)),  # an unknown tag
        msgspec.msgpack.encode({"abort": "r-0"}),  # not an array
        msgspec.msgpack.encode(("abort",)),  # a field missing
        msgspec.msgpack.encode(("abort", "r-0", "extra")),  # a field too many
        msgspec.msgpack.encode(("abort", 7)),  # a field of the wrong type
        msgspec.msgpack.encode(("stats", [1, 0, 0.5, 9, 8, 10, 5, 0, 0, "0"])),  # deep inside
    ],
)
def test_codec_refuses_anything_but_a_message(frame):
    with pytest.raises(TypeError, match="not a kvserve message"):
        messages.decode(frame)


def test_codec_checks_what_the_records_check():
    """A prompt's sampling parameters are validated again when they arrive."""
    message = _one_of_each_message()[0]
    raw = msgspec.msgpack.decode(messages.encode(message))
    raw[2]["params"]["temperature"] = -1.0
    with pytest.raises(TypeError, match="not a kvserve message: temperature must be >= 0.0"):
        messages.decode(msgspec.msgpack.encode(raw))


# --------------------------------------------------------------------------- AsyncLLM across the boundary


@pytest.fixture(scope="module")
def engine(llama_dir):
    eng = AsyncLLM(EngineArgs(model=llama_dir, dtype="float32", device="cpu", block_size=4))
    yield eng
    asyncio.run(eng.shutdown())


def test_every_output_field_matches_the_in_process_engine(engine, llama_dir):
    params = SamplingParams(
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=12,
        logprobs=3,
        prompt_logprobs=2,
        stop_token_ids=[17],
        min_tokens=2,
    )
    prompt = "The quick brown fox"

    async def run():
        return [out async for out in engine.generate(prompt, params, "all-fields")]

    streamed = asyncio.run(run())
    ref = LLM(llama_dir, dtype="float32", device="cpu", block_size=4).generate(
        prompt, params, use_tqdm=False
    )[0]
    final = streamed[-1]
    assert final.finished and not any(o.finished for o in streamed[:-1])
    assert final.prompt_token_ids == ref.prompt_token_ids and final.prompt == ref.prompt
    assert final.prompt_logprobs[0] is None and ref.prompt_logprobs[0] is None
    assert_same_logprobs(final.prompt_logprobs[1:], ref.prompt_logprobs[1:])
    for got, want in zip(final.outputs, ref.outputs, strict=True):
        assert (got.index, got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.index,
            want.text,
            want.token_ids,
            want.finish_reason,
            want.stop_reason,
        )
        assert_same_logprobs(got.logprobs, want.logprobs)
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob)
        # the deltas of all outputs add up to the final one
        assert "".join(o.outputs[got.index].delta_text for o in streamed) == got.text
        assert [t for o in streamed for t in o.outputs[got.index].delta_token_ids] == got.token_ids
        assert [e for o in streamed for e in o.outputs[got.index].delta_logprobs] == got.logprobs


def assert_same_logprobs(got, want):
    """The same tokens, ranks and text at every position; the values to within fp32 rounding (the
    two engines run in different processes, whose fp32 sums may round apart in the last bit)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert list(g) == list(w)
        for token_id, lp in g.items():
            assert (lp.rank, lp.decoded_token) == (w[token_id].rank, w[token_id].decoded_token)
            assert lp.logprob == pytest.approx(w[token_id].logprob, rel=1e-6, abs=1e-6)


def test_a_slow_consumer_gets_coalesced_outputs(engine):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    async def run():
        outs = []
        async for out in engine.generate([5, 6, 7], params, "slow"):
            outs.append(out)
            await asyncio.sleep(0.2)  # the engine runs on meanwhile
        return outs

    outs = asyncio.run(run())
    assert len(outs) < 30 and outs[-1].finished
    assert [t for o in outs for t in o.outputs[0].delta_token_ids] == outs[-1].outputs[0].token_ids
    assert len(outs[-1].outputs[0].token_ids) == 30


def test_core_killed_mid_stream(llama_dir):
    eng = AsyncLLM(EngineArgs(model=llama_dir, dtype="float32", device="cpu"))
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def run():
        got = 0
        with pytest.raises(EngineDeadError, match="exited"):
            async for _ in eng.generate([5, 6, 7], params, "doomed"):
                got += 1
                if got == 2:
                    os.kill(eng.core_pid, signal.SIGKILL)
        started = time.monotonic()
        while eng.is_healthy:
            await asyncio.sleep(0.01)
        assert time.monotonic() - started < 1.0
        with pytest.raises(EngineDeadError):
            async for _ in eng.generate([5, 6], params, "after"):
                pass
        await eng.shutdown()

    asyncio.run(run())
    assert not is_alive(eng.core_pid)


def test_start_up_errors_reach_the_caller(tmp_path):
    with pytest.raises(ValueError, match="model_type"):  # an empty directory: no config.json
        AsyncLLM(EngineArgs(model=str(tmp_path), dtype="float32", device="cpu"))


# --------------------------------------------------------------------------- the server's process


def stream_lines(url: str, max_tokens: int):
    """An open streaming completion: (response, line iterator)."""
    client = httpx.Client(timeout=60)
    request = client.build_request(
        "POST",
        url + "/v1/completions",
        json={
            "prompt": [5, 6, 7],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        },
    )
    response = client.send(request, stream=True)
    return client, response, response.iter_lines()


def data_events(lines) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


def test_server_exits_nonzero_when_its_core_is_killed(server_checkpoint):
    srv = ServerProcess(server_checkpoint).wait_ready()
    try:
        [core] = core_children(srv.proc.pid)
        client, response, lines = stream_lines(srv.url, 800)
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"]
        os.kill(core, signal.SIGKILL)
        rest = data_events(lines)
        client.close()
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["code"] == "engine_dead"
        srv.proc.wait(15)
        assert srv.proc.returncode == 1
        assert "engine is dead" in srv.log()
        assert not is_alive(core) and not core_children(srv.proc.pid)
    finally:
        srv.stop()


def test_sigterm_drains_streams_then_stops_the_core(server_checkpoint):
    srv = ServerProcess(server_checkpoint).wait_ready()
    try:
        [core] = core_children(srv.proc.pid)
        client, response, lines = stream_lines(srv.url, 40)
        next(line for line in lines if line.startswith("data: "))
        # both processes, as a service manager signals a whole group: the core ignores it and
        # keeps stepping until the server, once its streams are done, tells it to stop
        srv.proc.send_signal(signal.SIGTERM)
        os.kill(core, signal.SIGTERM)
        rest = data_events(lines)
        client.close()
        assert (
            rest[-1] == "[DONE]" and json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
        )
        srv.proc.wait(15)
        assert srv.proc.returncode in (
            0,
            -signal.SIGTERM,
        )  # uvicorn re-raises the signal once it has stopped
        wait_until(lambda: not is_alive(core), 5, "the core to exit")
    finally:
        srv.stop()


def test_no_core_left_when_the_server_is_killed(server_checkpoint):
    srv = ServerProcess(server_checkpoint).wait_ready()
    [core] = core_children(srv.proc.pid)
    srv.proc.kill()
    srv.proc.wait(5)
    wait_until(lambda: not is_alive(core), 10, "the orphaned core to exit")


@pytest.fixture(scope="module")
def server_checkpoint(tmp_path_factory):
    from server_fixtures import cached_checkpoint

    return cached_checkpoint(tmp_path_factory)


if sys.platform != "linux":  # /proc is how these tests find the core process
    pytestmark = pytest.mark.skip("needs Linux /proc")
