"""Bad requests get OpenAI-shaped 4xx errors (never a 500) and leave the server as it was;
API key, --max-queue and CORS on a guarded server."""

from __future__ import annotations

import httpx
import pytest

from server_fixtures import (  # noqa: F401  (pytest fixtures)
    MAX_MODEL_LEN,
    guarded_server,
    metric,
    server,
    server_checkpoint,
    wait_idle,
)

MSG = [{"role": "user", "content": "hi"}]
LONG = "The quick brown fox jumps over the lazy dog. " * 120  # well over 1024 tokens

# (id, path, json body or raw bytes, expected status, expected `param` (None: don't care), expected `code`)
BAD_REQUESTS = [
    ("missing-prompt", "/v1/completions", {"max_tokens": 4}, 400, "prompt", None),
    ("prompt-wrong-type", "/v1/completions", {"prompt": 123}, 400, "prompt", None),
    ("prompt-mixed-list", "/v1/completions", {"prompt": ["a", 1]}, 400, "prompt", None),
    ("prompt-empty-string", "/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("prompt-empty-list", "/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("prompt-empty-token-list", "/v1/completions", {"prompt": [[]]}, 400, "prompt", None),
    ("token-id-out-of-vocab", "/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt", None),
    ("token-id-negative", "/v1/completions", {"prompt": [-1]}, 400, "prompt", None),
    ("token-id-bool", "/v1/completions", {"prompt": [True]}, 400, "prompt", None),
    (
        "prompt-too-long",
        "/v1/completions",
        {"prompt": LONG},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "max-tokens-too-big",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": MAX_MODEL_LEN},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "max-tokens-negative",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": -1},
        400,
        "max_tokens",
        None,
    ),
    (
        "max-tokens-zero-no-echo",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 0},
        400,
        "max_tokens",
        None,
    ),
    (
        "max-tokens-string",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": "many"},
        400,
        "max_tokens",
        None,
    ),
    (
        "temperature-negative",
        "/v1/completions",
        {"prompt": "hi", "temperature": -0.5},
        400,
        "temperature",
        None,
    ),
    (
        "temperature-string",
        "/v1/completions",
        {"prompt": "hi", "temperature": "hot"},
        400,
        "temperature",
        None,
    ),
    ("top-p-zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("top-p-above-one", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p", None),
    ("top-k-below-minus-one", "/v1/completions", {"prompt": "hi", "top_k": -5}, 400, "top_k", None),
    ("min-p-above-one", "/v1/completions", {"prompt": "hi", "min_p": 2}, 400, "min_p", None),
    ("n-zero", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", None),
    ("n-huge", "/v1/completions", {"prompt": "hi", "n": 100000}, 400, "n", None),
    (
        "too-many-sequences",
        "/v1/completions",
        {"prompt": ["a"] * 2049, "n": 2},
        400,
        "prompt",
        None,
    ),
    (
        "logprobs-too-many",
        "/v1/completions",
        {"prompt": "hi", "logprobs": 21},
        400,
        "logprobs",
        None,
    ),
    (
        "stop-empty-string",
        "/v1/completions",
        {"prompt": "hi", "stop": ["", "x"]},
        400,
        "stop",
        None,
    ),
    (
        "stop-too-many",
        "/v1/completions",
        {"prompt": "hi", "stop": [str(i) for i in range(17)]},
        400,
        "stop",
        None,
    ),
    ("stop-wrong-type", "/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop", None),
    (
        "presence-penalty-range",
        "/v1/completions",
        {"prompt": "hi", "presence_penalty": 3},
        400,
        "presence_penalty",
        None,
    ),
    (
        "frequency-penalty-range",
        "/v1/completions",
        {"prompt": "hi", "frequency_penalty": -3},
        400,
        "frequency_penalty",
        None,
    ),
    (
        "repetition-penalty-zero",
        "/v1/completions",
        {"prompt": "hi", "repetition_penalty": 0},
        400,
        "repetition_penalty",
        None,
    ),
    (
        "min-tokens-over-max",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "min_tokens": 5},
        400,
        "min_tokens",
        None,
    ),
    (
        "stop-token-id-out-of-vocab",
        "/v1/completions",
        {"prompt": "hi", "stop_token_ids": [10**6]},
        400,
        "stop_token_ids",
        None,
    ),
    ("seed-string", "/v1/completions", {"prompt": "hi", "seed": "x"}, 400, "seed", None),
    ("n-fraction", "/v1/completions", {"prompt": "hi", "n": 1.5}, 400, "n", None),
    ("n-bool", "/v1/completions", {"prompt": "hi", "n": True}, 400, "n", None),
    (
        "max-tokens-numeric-string",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": "5"},
        400,
        "max_tokens",
        None,
    ),
    (
        "min-tokens-bool",
        "/v1/completions",
        {"prompt": "hi", "min_tokens": False},
        400,
        "min_tokens",
        None,
    ),
    (
        "logprobs-integral-float-over-limit",
        "/v1/completions",
        {"prompt": "hi", "logprobs": 21.0},
        400,
        "logprobs",
        None,
    ),
    ("stream-int", "/v1/completions", {"prompt": "hi", "stream": 1}, 400, "stream", None),
    ("echo-string", "/v1/completions", {"prompt": "hi", "echo": "maybe"}, 400, "echo", None),
    ("suffix", "/v1/completions", {"prompt": "hi", "suffix": "end"}, 400, "suffix", None),
    (
        "logit-bias-out-of-vocab",
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {"1000000": 5}},
        400,
        "logit_bias",
        None,
    ),
    ("best-of", "/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of", None),
    (
        "unknown-model",
        "/v1/completions",
        {"prompt": "hi", "model": "gpt-4"},
        404,
        "model",
        "model_not_found",
    ),
    ("bad-json", "/v1/completions", b'{"prompt": "hi",', 400, None, None),
    ("json-array", "/v1/completions", b'["hi"]', 400, None, None),
    ("empty-body", "/v1/completions", b"", 400, None, None),
    ("invalid-utf8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, None),
    ("chat-missing-messages", "/v1/chat/completions", {"max_tokens": 4}, 400, "messages", None),
    ("chat-empty-messages", "/v1/chat/completions", {"messages": []}, 400, "messages", None),
    (
        "chat-message-no-role",
        "/v1/chat/completions",
        {"messages": [{"content": "hi"}]},
        400,
        None,
        None,
    ),
    ("chat-message-not-object", "/v1/chat/completions", {"messages": ["hi"]}, 400, None, None),
    (
        "chat-image-part",
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        400,
        "messages.0.content",
        None,
    ),
    (
        "chat-top-logprobs-without-logprobs",
        "/v1/chat/completions",
        {"messages": MSG, "top_logprobs": 2},
        400,
        "top_logprobs",
        None,
    ),
    (
        "chat-top-logprobs-too-many",
        "/v1/chat/completions",
        {"messages": MSG, "logprobs": True, "top_logprobs": 50},
        400,
        "top_logprobs",
        None,
    ),
    (
        "chat-max-completion-tokens-zero",
        "/v1/chat/completions",
        {"messages": MSG, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        None,
    ),
    (
        "chat-too-long",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": LONG}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "chat-max-tokens-too-big",
        "/v1/chat/completions",
        {"messages": MSG, "max_tokens": MAX_MODEL_LEN},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "chat-tools",
        "/v1/chat/completions",
        {"messages": MSG, "tools": [{"type": "function"}]},
        400,
        "tools",
        None,
    ),
    (
        "chat-json-schema",
        "/v1/chat/completions",
        {"messages": MSG, "response_format": {"type": "json_schema"}},
        400,
        "response_format.json_schema",
        None,
    ),
    (
        "chat-unknown-model",
        "/v1/chat/completions",
        {"messages": MSG, "model": "nope"},
        404,
        "model",
        "model_not_found",
    ),
    (
        "chat-stream-bad-temperature",
        "/v1/chat/completions",
        {"messages": MSG, "stream": True, "temperature": 9},
        400,
        "temperature",
        None,
    ),
    ("tokenize-nothing", "/tokenize", {}, 400, "prompt", None),
    ("tokenize-both", "/tokenize", {"prompt": "a", "messages": MSG}, 400, "prompt", None),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [10**6]}, 400, "tokens", None),
    ("detokenize-strings", "/detokenize", {"tokens": ["a"]}, 400, "tokens.0", None),
]


def check_error_shape(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return error


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_request(server, path, body, status, param, code):
    if isinstance(body, bytes):
        resp = httpx.post(
            server.url + path, content=body, headers={"content-type": "application/json"}
        )
    else:
        resp = httpx.post(server.url + path, json=body)
    error = check_error_shape(resp, status)
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def test_integral_floats_are_integers(server):
    """JSON Schema's "integer" (what the OpenAPI document publishes) includes 2.0: accepted as 2."""
    body = {
        "prompt": [5.0, 6.0],
        "max_tokens": 3.0,
        "n": 2.0,
        "logprobs": 1.0,
        "seed": 7.0,
        "top_k": -1.0,
    }
    resp = httpx.post(server.url + "/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert len(choices) == 2 and all(len(c["logprobs"]["tokens"]) == 3 for c in choices)
    chat = {"messages": MSG, "max_completion_tokens": 2.0, "top_logprobs": 1.0, "logprobs": True}
    resp = httpx.post(server.url + "/v1/chat/completions", json=chat)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] <= 2


def test_unknown_route_method_and_size(server):
    check_error_shape(httpx.get(server.url + "/v1/nope"), 404)
    check_error_shape(httpx.post(server.url + "/v2/completions", json={}), 404)
    check_error_shape(httpx.get(server.url + "/v1/completions"), 405)
    check_error_shape(httpx.get(server.url + "/v1/models/gpt-4"), 404)
    big = {"prompt": "x" * (5 * 1024 * 1024)}
    assert (
        check_error_shape(httpx.post(server.url + "/v1/completions", json=big), 413)["code"]
        == "request_too_large"
    )

    def chunked():  # no Content-Length: the limit is enforced on the bytes that arrive
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"x" * (1024 * 1024)
        yield b'"}'

    resp = httpx.post(
        server.url + "/v1/completions",
        content=chunked(),
        headers={"content-type": "application/json"},
    )
    check_error_shape(resp, 413)


def test_server_unharmed_after_bad_requests(server):
    for case in BAD_REQUESTS[:5]:  # and once more, concurrently with a good request
        httpx.post(server.url + case[1], json=case[2])
    assert httpx.get(server.url + "/health").status_code == 200
    ok = httpx.post(
        server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    samples = wait_idle(server.url)
    assert metric(samples, "kvserve:kv_cache_usage_perc") == 0


# --------------------------------------------------------------------------- guarded server


def test_api_key(guarded_server):
    url = guarded_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        error = check_error_shape(httpx.get(url + "/v1/models", headers=headers), 401)
        assert error["code"] == "invalid_api_key"
        check_error_shape(
            httpx.post(url + "/v1/completions", json={"prompt": "hi"}, headers=headers), 401
        )
    auth = {"Authorization": "Bearer sekrit"}
    assert httpx.get(url + "/v1/models", headers=auth).status_code == 200
    assert (
        httpx.post(
            url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth
        ).status_code
        == 200
    )
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200


def test_cors(guarded_server):
    preflight = httpx.options(
        guarded_server.url + "/v1/completions",
        headers={
            "Origin": "http://example.test",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://example.test"
    other = httpx.get(guarded_server.url + "/health", headers={"Origin": "http://evil.test"})
    assert "access-control-allow-origin" not in other.headers


def test_max_queue_refuses_with_503(guarded_server):
    """--max-num-seqs 1 --max-queue 0: a request that would have to wait is refused."""
    url, auth = guarded_server.url, {"Authorization": "Bearer sekrit"}
    # n=2 needs two seats and there is one: the second sequence would wait.
    error = check_error_shape(
        httpx.post(url + "/v1/completions", json={"prompt": "hi", "n": 2}, headers=auth), 503
    )
    assert error["code"] == "server_overloaded"

    # While one long request runs, the next one would wait. The long one takes a second or two; on a
    # heavily loaded machine it may already be over when the second arrives, so try a few times.
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    statuses = []
    with httpx.Client(timeout=120) as client:
        for _ in range(3):
            with client.stream("POST", url + "/v1/completions", json=body, headers=auth) as running:
                assert running.status_code == 200
                # Keep the line iterator alive until the block ends: a discarded `iter_lines()` generator is
                # closed at once, and httpcore then closes the connection mid-response, so the server
                # (rightly) aborts the long request and frees its seat before the second one arrives.
                lines = running.iter_lines()
                next(lines)  # it has started
                refused = client.post(
                    url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth
                )
            statuses.append(refused.status_code)
            if refused.status_code == 503:
                assert check_error_shape(refused, 503)["code"] == "server_overloaded"
                assert int(refused.headers["retry-after"]) >= 1
                break
    assert statuses[-1] == 503, statuses
    wait_idle(url)
    again = httpx.post(
        url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth
    )
    assert again.status_code == 200
