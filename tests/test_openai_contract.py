"""The OpenAI contract's rough edges, each against a real server on the tiny checkpoint:
lone surrogates, undecodable tokens in legacy logprobs, text_offset around multi-byte characters,
float32 underflow in sampling parameters, fields OpenAI refuses, and /tokenizer_info."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from kvserve.engine import SamplingParams
from kvserve.engine.outputs import Logprob
from kvserve.engine.sampling_params import MIN_TOP_P
from kvserve.server.logprobs import TextOffsets, TokenText, completion_logprobs
from server_fixtures import server, server_checkpoint, wait_idle  # noqa: F401  (pytest fixtures)

MSG = [{"role": "user", "content": "hi"}]


def _post(server, path: str, body: dict | str) -> httpx.Response:  # noqa: F811
    """POST JSON; a str body is sent as is (to carry escapes such as a lone surrogate)."""
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(
        server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60
    )


def _stream_logprobs(server, body: dict) -> tuple[str, list[str], list[int]]:  # noqa: F811
    text, tokens, offsets = "", [], []
    with httpx.stream(
        "POST", server.base_url + "/completions", json={**body, "stream": True}, timeout=60
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                text += choice["text"]
                if choice["logprobs"]:
                    tokens += choice["logprobs"]["tokens"]
                    offsets += choice["logprobs"]["text_offset"]
    return text, tokens, offsets


# --------------------------------------------------------------------------- lone surrogates


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}'),
        ("/v1/completions", '{"prompt": ["x", "a\\udfffb"], "max_tokens": 2, "stop": ["\\ud800"]}'),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}], "max_tokens": 2}',
        ),
        ("/tokenize", '{"prompt": "a\\ud800b"}'),
        ("/tokenize", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    ],
    ids=[
        "completion",
        "completion-list-and-stop",
        "chat",
        "chat-part",
        "tokenize",
        "tokenize-chat",
    ],
)
def test_lone_surrogates_are_replaced_not_a_500(server, path, body):  # noqa: F811
    resp = _post(server, path, body)
    assert resp.status_code == 200, resp.text


def test_lone_surrogate_becomes_the_replacement_character(server):  # noqa: F811
    replaced = _post(server, "/tokenize", '{"prompt": "a\\ud800b"}').json()["tokens"]
    assert replaced == _post(server, "/tokenize", {"prompt": "a\ufffdb"}).json()["tokens"]
    echo = _post(
        server, "/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 1, "echo": true}'
    ).json()
    assert echo["choices"][0]["text"].startswith("a\ufffdb")
    pair = _post(server, "/tokenize", '{"prompt": "\\ud83d\\ude80"}').json()[
        "tokens"
    ]  # a valid pair is kept
    assert pair == _post(server, "/tokenize", {"prompt": "🚀"}).json()["tokens"]


# --------------------------------------------------------------------------- legacy logprobs: bytes keys


def test_undecodable_pieces_get_unique_bytes_keys(tmp_path):
    from checkpoints import save_tokenizer

    tokenizer = save_tokenizer(tmp_path)
    ids = tokenizer.encode("東京")
    assert len(ids) > 2  # split into byte pieces, each "\ufffd" when decoded alone
    entries = [
        {i: Logprob(-0.1 * rank, rank, tokenizer.decode([i])) for rank, i in enumerate(ids, 1)}
        for _ in ids
    ]
    result = completion_logprobs(ids, entries, len(ids), TokenText(tokenizer))
    for key, top in zip(result.tokens, result.top_logprobs):
        assert len(top) == len(ids) and key in top
    assert all(key.startswith("bytes:\\x") for key in result.tokens[:2])
    raw = b"".join(
        bytes.fromhex(key[6:].replace("\\x", "")) if key.startswith("bytes:") else key.encode()
        for key in result.tokens
    )
    assert raw.decode() == "東京"


def test_top_logprobs_keep_k_unique_entries_with_the_greedy_token(server):  # noqa: F811
    resp = _post(
        server,
        "/v1/completions",
        {"prompt": "東京 fox", "max_tokens": 8, "temperature": 0, "logprobs": 5},
    )
    logprobs = resp.json()["choices"][0]["logprobs"]
    assert any(
        token.startswith("bytes:\\x") for token in logprobs["tokens"]
    )  # the case at hand occurs
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"]):
        assert len(top) == 5 and token in top
        assert top[token] == max(top.values())  # greedy


# --------------------------------------------------------------------------- text_offset


def _check_offsets(text: str, tokens: list[str], offsets: list[int]) -> None:
    assert offsets == sorted(offsets) and len(offsets) == len(tokens)
    for token, offset in zip(tokens, offsets):
        if not token.startswith("bytes:"):
            assert text.startswith(token, offset), (token, offset, text)


@pytest.mark.parametrize("max_tokens", [0, 6], ids=["scoring", "generating"])
def test_text_offset_counts_characters_streamed_or_not(server, max_tokens):  # noqa: F811
    body = {
        "prompt": "東京 fox",
        "echo": True,
        "max_tokens": max_tokens,
        "logprobs": 3,
        "temperature": 0,
    }
    choice = _post(server, "/v1/completions", body).json()["choices"][0]
    logprobs = choice["logprobs"]
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    fox = tokens.index(" fox")
    # 東 is split over three byte pieces (the third also starts nothing new), then 京, then " fox"
    assert tokens[: fox + 1] == ["bytes:\\xe6", "bytes:\\x9d", "bytes:\\xb1", "京", " fox"]
    assert offsets[: fox + 1] == [0, 0, 0, 1, 2]
    _check_offsets(choice["text"], tokens, offsets)
    streamed = _stream_logprobs(server, body)
    assert streamed == (choice["text"], tokens, offsets)


def test_text_offset_across_stream_chunks_without_echo(server):  # noqa: F811
    body = {"prompt": "東京", "max_tokens": 12, "logprobs": 1, "temperature": 0}
    choice = _post(server, "/v1/completions", body).json()["choices"][0]
    _check_offsets(choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"])
    assert _stream_logprobs(server, body) == (
        choice["text"],
        choice["logprobs"]["tokens"],
        choice["logprobs"]["text_offset"],
    )


def test_text_offsets_share_a_split_character(tmp_path):
    from checkpoints import save_tokenizer

    tokenizer = save_tokenizer(tmp_path)
    token_text = TokenText(tokenizer)
    ids = tokenizer.encode("東京 fox")
    offsets = TextOffsets(token_text, skip_special_tokens=True)
    first = [offsets.next(i) for i in ids[:3]]
    rest = TextOffsets(token_text, skip_special_tokens=True)  # fed in two parts: same as in one
    for i in ids[:3]:
        rest.next(i)
    assert first + [offsets.next(i) for i in ids[3:]] == first + [rest.next(i) for i in ids[3:]]
    eos = tokenizer.eos_token_id
    assert TextOffsets(token_text, True).next(eos) == 0
    skipped = TextOffsets(token_text, True)
    skipped.next(eos)
    assert skipped.num_chars == 0  # a skipped special token adds nothing to the text
    shown = TextOffsets(token_text, False)
    shown.next(eos)
    assert shown.num_chars == len(tokenizer.eos_token)


# --------------------------------------------------------------------------- float32 underflow


def test_sampling_params_clamp_top_p_and_bound_repetition_penalty():
    assert SamplingParams(top_p=1e-50).top_p == MIN_TOP_P
    assert SamplingParams(top_p=0.5).top_p == 0.5
    for value in (1e-39, 1e39, 1e-5):
        with pytest.raises(ValueError, match=re.escape(f"got {value}")):
            SamplingParams(repetition_penalty=value)


def _completion(server, **fields) -> dict:  # noqa: F811
    resp = _post(
        server, "/v1/completions", {"prompt": "The quick brown", "max_tokens": 8, **fields}
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_underflowing_parameters_do_not_turn_every_token_into_eos(server):  # noqa: F811
    greedy = _completion(server, temperature=0)
    assert greedy["finish_reason"] == "length"
    for fields in (
        {"top_p": 1e-50},
        {"top_p": 1e-45, "seed": 3},
        {"temperature": 1e-39},
        {"temperature": 1e-6},
    ):
        assert _completion(server, **fields)["text"] == greedy["text"], (
            fields
        )  # only the top token is left
    sampled = _completion(server, temperature=1, seed=7)
    for fields in ({"min_p": 1e-50}, {"min_p": 1e-45}, {"frequency_penalty": 1e-50}):
        assert _completion(server, temperature=1, seed=7, **fields)["text"] == sampled["text"], (
            fields
        )


@pytest.mark.parametrize("value", [1e-39, 1e39, 1e-5, 10**5])
def test_repetition_penalty_outside_float32_range_is_a_400(server, value):  # noqa: F811
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": MSG}),
    ):
        resp = _post(server, path, {**body, "repetition_penalty": value, "max_tokens": 2})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "repetition_penalty" and f"{value:g}" in error["message"]


# --------------------------------------------------------------------------- fields OpenAI refuses


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": MSG, "tool_choice": "auto"}, "tool_choice"),
        (
            "/v1/chat/completions",
            {"messages": MSG, "tool_choice": "none", "tools": []},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"messages": MSG, "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"messages": MSG, "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (
            "/v1/chat/completions",
            {"messages": MSG, "stream": False, "stream_options": {}},
            "stream_options",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
    ],
)
def test_fields_openai_refuses_are_a_400(server, path, body, param):  # noqa: F811
    resp = _post(server, path, {**body, "max_tokens": 2})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_fields_openai_accepts_still_work(server):  # noqa: F811
    for path, body in (
        ("/v1/chat/completions", {"messages": MSG, "tool_choice": None}),
        ("/v1/chat/completions", {"messages": MSG, "stream_options": None}),
        (
            "/v1/chat/completions",
            {"messages": MSG, "stream": True, "stream_options": {"include_usage": True}},
        ),
        (
            "/v1/chat/completions",
            {
                "messages": MSG,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "none",
            },
        ),
    ):
        resp = _post(server, path, {**body, "max_tokens": 2})
        assert resp.status_code == 200, (body, resp.text)
    wait_idle(server.url)


# --------------------------------------------------------------------------- /tokenizer_info


def test_tokenizer_info(server):  # noqa: F811
    resp = httpx.get(server.url + "/tokenizer_info", timeout=10)
    assert resp.status_code == 200
    info = resp.json()
    assert info["eos_token"] == "<|endoftext|>" and info["bos_token"] == "<|endoftext|>"
    assert info["tokenizer_class"] and info["model_max_length"] == 1024
    assert "<|im_start|>" in info["chat_template"]
    assert not any(
        key.endswith("_file") or key == "name_or_path" for key in info
    )  # no server paths
    # lm-eval's remote tokenizer: eos_token present, then /tokenize without special tokens
    eos = _post(
        server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}
    ).json()["tokens"]
    assert len(eos) == 1
