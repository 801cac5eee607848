"""Deeply nested JSON in any free-form field: refused with a 400 on the raw body, before anything
parses or walks it; a legitimately deep request still works. Both on the app with a scripted
engine (every field, no model) and on a real `kvserve serve` (the log stays quiet)."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from fastapi.testclient import TestClient

from kvserve.server.config import ServerConfig
from kvserve.server.json_depth import MAX_JSON_DEPTH, json_depth
from kvserve.server.protocol import replace_lone_surrogates
from server_fixtures import server, server_checkpoint  # noqa: F401  (pytest fixtures)
from test_server_unit import FakeEngine

MSG = [{"role": "user", "content": "hi"}]
TOO_DEEP = (MAX_JSON_DEPTH + 1, 470, 500, 985, 1000)


# --------------------------------------------------------------------------- the scan


def _depth(value) -> int:
    """Nesting depth of parsed JSON, the slow way (iteratively)."""
    best, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            best = max(best, depth)
            stack.extend(
                (child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)
            )
    return best


def _random_json(rng: random.Random, depth: int = 0):
    if depth > 30 or rng.random() < 0.2:
        return rng.choice(["", 'a"b', "[{", "\\", '\\"[', "\u00e9]}", 1, 2.5, None, True])
    if rng.random() < 0.5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {
        rng.choice(["k", "[", '"{', "\\"]) + str(i): _random_json(rng, depth + 1)
        for i in range(rng.randint(0, 3))
    }


def test_json_depth_matches_the_parsed_depth():
    rng = random.Random(0)
    for _ in range(500):
        value = _random_json(rng)
        for ensure_ascii in (True, False):
            body = json.dumps(value, ensure_ascii=ensure_ascii).encode()
            assert json_depth(body, stop_above=0) == _depth(value), body


@pytest.mark.parametrize(
    ("body", "depth"),
    [
        (b'"[[[["', 0),
        (b"3", 0),
        (b"{}", 1),
        (b'{"a": [1, {"b": []}]}', 4),
        (b'{"a": "x\\\\"}', 1),
        (b'["\\"[[", [["\\\\\\"]"]]]', 3),
        (b'[["\\\\", "]]]"], [[[]]]]', 4),
    ],
)
def test_json_depth_ignores_brackets_in_strings(body, depth):
    json.loads(body)  # valid JSON
    assert json_depth(body, stop_above=0) == depth


def test_json_depth_counts_only_when_it_must():
    body = json.dumps({"prompt": "[" * 100}).encode()  # 101 opening brackets: at most 101 deep
    assert json_depth(body) == 101
    assert json_depth(b"[" * 200 + b"]" * 200) == 200


def test_surrogate_walk_needs_no_recursion():
    deep: object = "a\ud800"
    for _ in range(50_000):
        deep = [deep]
    fixed = replace_lone_surrogates({"x": deep, "ids": [1, 2]})["x"]
    for _ in range(50_000):
        fixed = fixed[0]
    assert fixed == "a\ufffd"
    original = {"k\udc00": ["\ud800", {"n": None}]}
    assert replace_lone_surrogates(original) == {"k\ufffd": ["\ufffd", {"n": None}]}
    assert original == {"k\udc00": ["\ud800", {"n": None}]}  # copied, not changed


# --------------------------------------------------------------------------- bodies nested `depth` deep
# Built as text: json.dumps itself recurses, and the deepest bodies are beyond Python's limit.


def _nested(depth: int) -> str:
    """JSON text `depth` levels deep: lists around an object."""
    return "[" * (depth - 1) + '{"k": "x"}' + "]" * (depth - 1) if depth > 0 else '"x"'


def _schema(depth: int) -> str:
    """A valid JSON Schema, as text, `depth` levels deep: arrays of arrays of ... strings."""
    return '{"type": "array", "items": ' * (depth - 1) + '{"type": "string"}' + "}" * (depth - 1)


MSG_TEXT = json.dumps(MSG)


def deep_body(field: str, depth: int) -> tuple[str, str]:
    """(path, JSON body) whose nesting is exactly `depth`, the deep part in `field`."""
    if field == "prompt":
        return "/v1/completions", f'{{"prompt": {_nested(depth - 1)}, "max_tokens": 1}}'
    if field == "unknown":
        return (
            "/v1/completions",
            f'{{"prompt": "hi", "max_tokens": 1, "extra_field": {_nested(depth - 1)}}}',
        )
    if field == "chat_template_kwargs":
        return "/v1/chat/completions", (
            f'{{"messages": {MSG_TEXT}, "max_tokens": 1, '
            f'"chat_template_kwargs": {{"extra": {_nested(depth - 2)}}}}}'
        )
    if field == "message_key":
        return "/v1/chat/completions", (
            f'{{"messages": [{{"role": "user", "content": "hi", '
            f'"extra": {_nested(depth - 3)}}}], "max_tokens": 1}}'
        )
    if field == "response_format":
        return "/v1/chat/completions", (
            f'{{"messages": {MSG_TEXT}, "max_tokens": 1, "response_format": '
            f'{{"type": "json_schema", "json_schema": {{"name": "deep", '
            f'"schema": {_schema(depth - 3)}}}}}}}'
        )
    if field == "tool_parameters":
        parameters = f'{{"type": "object", "properties": {{"a": {_schema(depth - 6)}}}}}'
        return "/v1/chat/completions", (
            f'{{"messages": {MSG_TEXT}, "max_tokens": 1, "tools": [{{"type": '
            f'"function", "function": {{"name": "f", "parameters": {parameters}}}}}]}}'
        )
    raise ValueError(field)


FIELDS = (
    "prompt",
    "unknown",
    "chat_template_kwargs",
    "message_key",
    "response_format",
    "tool_parameters",
)
JSON = {"content-type": "application/json"}


def test_deep_bodies_are_as_deep_as_asked():
    for field in FIELDS:
        for depth in (MAX_JSON_DEPTH, *TOO_DEEP):
            path, body = deep_body(field, depth)
            assert json_depth(body.encode(), 0) == depth, (field, depth)
        json.loads(deep_body(field, MAX_JSON_DEPTH)[1])  # valid JSON


def check_too_deep(resp: httpx.Response) -> None:
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert error["code"] == "json_too_deep" and error["type"] == "invalid_request_error"
    assert f"at most {MAX_JSON_DEPTH} levels" in error["message"]


# --------------------------------------------------------------------------- the app on a scripted engine

# renders everything it is given, so the allowed depth goes through Jinja's tojson too
WALKING_TEMPLATE = (
    "{% for m in messages %}{{ m | tojson }}{% endfor %}{{ tools | tojson }}"
    "{{ extra | default('') | tojson }}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from checkpoints import save_tokenizer

    return save_tokenizer(tmp_path_factory.mktemp("limits_tokenizer"))


@pytest.fixture()
def client(tokenizer):
    from kvserve.server.app import create_app

    engine = FakeEngine(tokenizer)
    engine.model_config.max_model_len = (
        1 << 20
    )  # the walking template renders the deep data into the prompt
    # the schema's own nesting limit (--max-schema-depth) raised, so that every field reaches the JSON bound
    config = ServerConfig(
        stats_log_interval=0, chat_template=WALKING_TEMPLATE, max_schema_depth=4 * MAX_JSON_DEPTH
    )
    with TestClient(create_app(config, engine=engine), raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("field", FIELDS)
def test_too_deep_is_a_400_in_every_field(client, field):
    for depth in TOO_DEEP:
        path, body = deep_body(field, depth)
        check_too_deep(client.post(path, content=body, headers=JSON))


@pytest.mark.parametrize("field", FIELDS)
def test_the_allowed_depth_works_in_every_field(client, field):
    path, body = deep_body(field, MAX_JSON_DEPTH)
    resp = client.post(path, content=body, headers=JSON)
    if field == "prompt":  # nested lists are no prompt: a type error, not a crash
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text[
            :300
        ]
    else:
        assert resp.status_code == 200, resp.text[:300]


@pytest.mark.parametrize("param", ["guided_json", "structured_outputs"])
def test_a_schema_sent_as_a_string_is_checked_too(client, param):
    deep = _schema(3000)
    body = {
        "prompt": "hi",
        "max_tokens": 1,
        **(
            {"guided_json": deep}
            if param == "guided_json"
            else {"structured_outputs": {"json": deep}}
        ),
    }
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "json_too_deep", resp.text[
        :300
    ]
    assert resp.json()["error"]["param"] == param


def test_tokenize_and_detokenize_are_covered(client):
    check_too_deep(
        client.post(
            "/tokenize",
            content=f'{{"messages": [{{"role": "user", "x": {_nested(600)}}}]}}',
            headers=JSON,
        )
    )
    check_too_deep(
        client.post("/detokenize", content=f'{{"tokens": {_nested(600)}}}', headers=JSON)
    )


# --------------------------------------------------------------------------- a real server


def test_real_server_refuses_deep_json_with_one_log_line_at_most(server):  # noqa: F811
    num_requests = 0
    before = server.log()
    for field in FIELDS:
        for depth in TOO_DEEP:
            path, body = deep_body(field, depth)
            check_too_deep(httpx.post(server.url + path, content=body, headers=JSON, timeout=60))
            num_requests += 1
    new = server.log()[len(before) :]
    assert "Traceback" not in new and "RecursionError" not in new, new[-2000:]
    # the core's KV pool prefault logs once, from a background thread, whenever it finishes
    lines = [line for line in new.splitlines() if "KV pool faulted in" not in line]
    assert len(lines) <= num_requests, new[-2000:]


@pytest.mark.parametrize(
    "field",
    ["unknown", "chat_template_kwargs", "message_key", "response_format", "tool_parameters"],
)
def test_real_server_serves_the_allowed_depth(server, field):  # noqa: F811
    """At the JSON bound every field is read without a crash; a response_format schema that deep is
    then refused by the grammar's own, lower nesting limit (--max-schema-depth), with a 400 that
    says so (tool parameters are compiled only under tool_choice required or named)."""
    path, body = deep_body(field, MAX_JSON_DEPTH)
    resp = httpx.post(server.url + path, content=body, headers=JSON, timeout=120)
    if field == "response_format":
        assert resp.status_code == 400 and "nested more than" in resp.json()["error"]["message"], (
            resp.text[:300]
        )
    else:
        assert resp.status_code == 200, resp.text[:300]
