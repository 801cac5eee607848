"""Bounded grammar work: size limits, the compile time limit, cancelled compiles, the compile
queue bound and the `num_requests_compiling` gauge (engine/structured_output/limits.py,
engine/structured_output/compile_threads.py, engine/structured_output/grammar.py, server/validation.py).

Slow compiles are made two ways: in-process, by swapping the manager's `_compile` for one that
waits on a gate (deterministic); over HTTP, with a schema of many optional properties, whose
compile grows faster than its size (seconds for the sizes used here, far beyond the tiny
limits configured). No test asserts how long anything took.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("xgrammar")

from kvserve.engine import LLM, SamplingParams  # noqa: E402
from kvserve.engine.config import EngineArgs  # noqa: E402
from kvserve.engine.errors import EngineOverloadedError  # noqa: E402
from kvserve.engine.sampling_params import StructuredOutputs  # noqa: E402
from kvserve.engine.structured_output.limits import GrammarLimits, check_limits  # noqa: E402
from kvserve.engine.structured_output.schema import walk_schema  # noqa: E402
from server_fixtures import ServerProcess, metric, scrape, server_checkpoint  # noqa: E402,F401

LIMITS = dict(
    max_schema_properties=2500,
    max_schema_depth=6,
    max_schema_enum_values=4,
    max_schema_string_chars=50_000,
    max_regex_chars=20,
    max_grammar_chars=40,
    max_choices=3,
    max_choice_chars=20,
)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _props(n: int, name_len: int = 4) -> dict:
    return {
        "type": "object",
        "properties": {f"p{i}".ljust(name_len, "x"): {"type": "string"} for i in range(n)},
    }


# (spec, the option its error names, the value it reports)
OVER_LIMIT = [
    (StructuredOutputs(json=_props(2501)), "max_schema_properties=2500", "2501 object properties"),
    (StructuredOutputs(json=_nested(7)), "max_schema_depth=6", "more than 6 levels"),
    (
        StructuredOutputs(json={"enum": ["a", "b", "c", "d", "e"]}),
        "max_schema_enum_values=4",
        "5 enum values",
    ),
    (
        StructuredOutputs(json=_props(2, 25_001)),
        "max_schema_string_chars=50000",
        "50002 characters",
    ),
    (StructuredOutputs(regex="a" * 21), "max_regex_chars=20", "21 characters"),
    (
        StructuredOutputs(grammar='root ::= "' + "a" * 40 + '"'),
        "max_grammar_chars=40",
        "51 characters",
    ),
    (StructuredOutputs(choice=["a", "b", "c", "d"]), "max_choices=3", "4 strings"),
    (StructuredOutputs(choice=["a" * 11, "b" * 10]), "max_choice_chars=20", "21 characters"),
]


@pytest.mark.parametrize("spec, option, value", OVER_LIMIT)
def test_each_limit_is_a_value_error(spec, option, value):
    with pytest.raises(
        ValueError, match=rf"^structured_outputs\.{spec.kind}: .*{value}.*\({option}\)"
    ):
        check_limits(spec, GrammarLimits(**LIMITS))
    check_limits(spec, GrammarLimits(**{**LIMITS, option.split("=")[0]: 10**6}))  # that limit alone


def test_deep_schemas_never_recurse():
    deep = _nested(50_000)  # far past Python's recursion limit
    spec = StructuredOutputs(json=deep)  # the keyword walk is iterative
    with pytest.raises(
        ValueError, match=r"nested more than 32 levels deep, at #/\.\.\./.*properties/a \("
    ):
        check_limits(spec, GrammarLimits())
    with pytest.raises(
        ValueError, match="unsupported JSON Schema keyword 'not' at #/properties/a/properties/a"
    ):
        StructuredOutputs(
            json={"type": "object", "properties": {"a": {"properties": {"a": {"not": {}}}}}}
        )
    assert walk_schema(_nested(3)).max_depth == 3
    with pytest.raises(ValueError, match="nested too deeply to parse"):
        StructuredOutputs(json="[" * 100_000 + "]" * 100_000)


@pytest.fixture(scope="module")
def llm(llama_dir):
    engine = LLM(
        llama_dir,
        dtype="float32",
        device="cpu",
        grammar_compile_threads=1,
        max_grammar_queue=2,
        grammar_compile_timeout_s=0.3,
        **LIMITS,
    )
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("spec, option, value", OVER_LIMIT)
def test_offline_limits(llm, spec, option, value):
    with pytest.raises(ValueError, match=rf"{value}.*\({option}\)"):
        llm.generate("hi", SamplingParams(max_tokens=4, structured_outputs=spec), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


class Gate:
    """Makes the manager's compiles wait until released; counts the compiles that started."""

    def __init__(self, manager) -> None:
        self.manager, self.original = manager, manager._compile
        self.release, self.started = threading.Event(), []

    def __enter__(self) -> Gate:
        def gated(spec):
            self.started.append(spec)
            assert self.release.wait(30)
            return self.original(spec)

        self.manager._compile = gated
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.manager._compile = self.original


def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _drain(engine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    return outs


def test_timeout_fails_cleanly_and_others_go_on(llm):
    engine, manager = llm.engine, llm.engine.structured
    free_blocks = engine.kv_cache_manager.num_free_blocks
    with Gate(manager) as gate:
        engine.add_request(
            "slow",
            "hi",
            SamplingParams(structured_outputs=StructuredOutputs(regex="x+"), max_tokens=4),
        )
        engine.add_request("other", "hi", SamplingParams(max_tokens=8, ignore_eos=True))
        _wait_for(lambda: gate.started)
        assert engine.stats().num_compiling == 1  # the gauge's source, while the compile is held
        finished, error = [], None
        while engine.has_unfinished_requests():
            try:
                finished += [o.request_id for o in engine.step() if o.finished]
            except ValueError as e:
                error = str(e)
        assert (
            error is not None
            and "could not be compiled within 0.3 s (grammar_compile_timeout_s=0.3)" in error
        )
        assert finished == ["other"]
        stats = engine.stats()
        assert (
            stats.num_compiling == 0 and stats.num_grammars_compiling == 1
        )  # abandoned, still running
    _wait_for(lambda: manager._sweep() or manager.num_jobs == 0)  # it finished and was cached
    assert engine.kv_cache_manager.num_free_blocks == free_blocks


def test_abort_cancels_queued_and_abandons_running_compiles(llm):
    engine, manager = llm.engine, llm.engine.structured
    with Gate(manager) as gate:
        engine.add_request(
            "running", "hi", SamplingParams(structured_outputs=StructuredOutputs(regex="r+"))
        )
        _wait_for(lambda: len(gate.started) == 1)
        engine.add_request(
            "queued", "hi", SamplingParams(structured_outputs=StructuredOutputs(regex="q+"))
        )
        queued_job = manager._pending["queued"].job
        running_job = manager._pending["running"].job
        engine.abort("queued")
        assert queued_job.future.cancelled() and manager.num_jobs == 1
        engine.abort("running")
        assert running_job.is_abandoned and not running_job.future.done()
        assert not engine.has_unfinished_requests() and not manager.has_pending
        # a new compile does not wait for the abandoned one: a fresh thread takes it
        engine.add_request(
            "next", "hi", SamplingParams(structured_outputs=StructuredOutputs(regex="n+"))
        )
        _wait_for(lambda: len(gate.started) == 2)  # while the abandoned one is still held
        engine.abort("next")
    _wait_for(lambda: manager.num_jobs == 0)  # both finish once released
    _wait_for(lambda: manager._pool.num_threads_alive <= 1)  # the abandoned one's thread exits
    assert [s.regex for s in gate.started] == ["r+", "n+"]  # the queued one never compiled
    manager._sweep()
    assert manager.num_jobs == 0 and not manager.has_pending
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks - 1
    assert engine.output_processor.parents == {}


def test_compile_queue_bound(llm):
    engine, manager = llm.engine, llm.engine.structured
    with Gate(manager):
        for i in range(2):
            engine.add_request(
                f"q{i}", "hi", SamplingParams(structured_outputs=StructuredOutputs(regex=f"{i}+"))
            )
        # a spec already compiling shares its job and is admitted
        engine.add_request(
            "shared", "hi", SamplingParams(structured_outputs=StructuredOutputs(regex="0+"))
        )
        with pytest.raises(
            EngineOverloadedError,
            match=r"2 grammars are compiling or queued \(max_grammar_queue=2\)",
        ):
            engine.add_request(
                "over", "hi", SamplingParams(structured_outputs=StructuredOutputs(regex="9+"))
            )
        assert "over" not in engine.output_processor.parents
    assert len(_drain(engine)) == 3


def test_engine_args_check_the_grammar_options():
    for kwargs, message in [
        ({"grammar_compile_timeout_s": 0}, "grammar_compile_timeout_s"),
        ({"max_grammar_queue": 0}, "max_grammar_queue"),
        ({"max_schema_depth": 0}, "max_schema_depth"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineArgs(**kwargs).validate()


# ---------------------------------------------------------------------------------------------- HTTP

SLOW_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}


@pytest.fixture(scope="module")
def limited_server(server_checkpoint):
    args = [f"--{name.replace('_', '-')}={value}" for name, value in LIMITS.items()]
    srv = ServerProcess(
        server_checkpoint,
        *args,
        "--max-tools",
        "2",
        "--grammar-compile-timeout-s",
        "2",
        "--max-grammar-queue",
        "1",
        "--grammar-compile-threads",
        "1",
    ).wait_ready()
    yield srv
    srv.stop()


def _tool(name: str, parameters: dict | None = None) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "parameters": parameters or {"type": "object"}},
    }


def _chat(url: str, **body) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def _guided(spec: StructuredOutputs) -> dict:
    field = {
        "json": "guided_json",
        "regex": "guided_regex",
        "grammar": "guided_grammar",
        "choice": "guided_choice",
    }
    return {
        field[spec.kind]: list(spec.choice) if spec.kind == "choice" else getattr(spec, spec.kind)
    }


@pytest.mark.parametrize("spec, option, value", OVER_LIMIT)
def test_http_limits_are_400s(limited_server, spec, option, value):
    r = _chat(limited_server.url, **_guided(spec))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == next(iter(_guided(spec)))
    assert value in error["message"] and option in error["message"]


def test_http_tools_limits(limited_server):
    url = limited_server.url
    r = _chat(url, tools=[_tool(f"f{i}") for i in range(3)])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "3 tools; at most 2 are allowed (--max-tools 2)" in r.json()["error"]["message"]
    r = _chat(
        url, tools=[_tool("f", _nested(7))], tool_choice="required"
    )  # the call wraps it 3 levels deeper
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "max_schema_depth=6" in r.json()["error"]["message"]
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"enum": list("abcde")}},
    }
    r = _chat(url, response_format=schema)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "max_schema_enum_values=4" in r.json()["error"]["message"]


def test_http_timeout_queue_bound_and_gauge(limited_server):
    """A slow compile: the gauge shows it, a second grammar gets 503 while it holds the queue, it
    fails with a 400 at the time limit, and a concurrent stream finishes normally throughout."""
    url = limited_server.url
    results: dict = {}

    def stream() -> None:
        body = {"prompt": "hello", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            results["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    def slow() -> None:
        results["slow"] = _chat(url, guided_json=SLOW_SCHEMA)

    threads = [threading.Thread(target=slow), threading.Thread(target=stream)]
    threads[0].start()
    _wait_for(lambda: metric(scrape(url), "kvserve:num_requests_compiling") == 1)
    threads[1].start()
    r = _chat(url, guided_regex="[0-9]+")  # another grammar: the queue (1) is full
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert (
        r.json()["error"]["code"] == "server_overloaded"
        and "max_grammar_queue=1" in r.json()["error"]["message"]
    )
    r = _chat(url, max_tokens=3)  # no grammar: unaffected
    assert r.status_code == 200
    for t in threads:
        t.join(120)
    slow_response = results["slow"]
    assert slow_response.status_code == 400
    assert slow_response.json()["error"]["param"] == "guided_json"
    assert (
        "could not be compiled within 2 s (grammar_compile_timeout_s=2)"
        in slow_response.json()["error"]["message"]
    )
    assert results["stream"][-1] == "data: [DONE]"
    assert json.loads(results["stream"][-2][6:])["choices"][0]["finish_reason"] == "length"
    samples = scrape(url)
    assert metric(samples, "kvserve:num_requests_compiling") == 0
    assert metric(samples, "kvserve:num_requests_running") == 0
    # its compile goes on, abandoned: the grammar gauge shows it, and it still holds the queue
    assert metric(samples, "kvserve:num_grammars_compiling") == 1
    assert _chat(url, guided_regex="[a-z]+").status_code == 503


def test_offline_generate_refused_by_the_queue_leaves_nothing(llm):
    engine = llm.engine
    specs = [
        StructuredOutputs(regex=f"{c}+") for c in "uvw"
    ]  # three new grammars, the queue holds two
    with Gate(engine.structured), pytest.raises(EngineOverloadedError):
        llm.generate(
            ["hi"] * 3, [SamplingParams(structured_outputs=s) for s in specs], use_tqdm=False
        )
    assert not engine.has_unfinished_requests() and engine.output_processor.parents == {}
