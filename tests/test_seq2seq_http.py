"""`decoder_prompt` on /v1/completions: an encoder-decoder's decoder prefix over HTTP.

The app runs in-process on a real `AsyncLLM` (a tiny random mBART); each answer must equal the
offline `LLM.generate` / `LLM.beam_search` given the same `decoder_prompt_token_ids`, streamed or
not, with logprobs, n, several prompts and stop strings. Bad values are 400s naming the field and
leave every KV block in the pool; on a decoder-only model the field is a 400 too."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from checkpoints import save_tokenizer
from kvserve.engine import LLM, AsyncLLM, BeamSearchParams, EngineArgs, SamplingParams
from kvserve.server.app import create_app
from kvserve.server.config import ServerConfig
from test_seq2seq_models import random_checkpoint

VOCAB = 384  # the test tokenizer's
SOURCES = [[5, 17, 42, 99, 7, 250, 31], [120, 3, 64, 9]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(offline LLM, in-process test client, its AsyncLLM, decoder start token) on one checkpoint."""
    path = tmp_path_factory.mktemp("mbart")
    hf = random_checkpoint("mbart", path, vocab_size=VOCAB)
    save_tokenizer(path)
    args = dict(model=str(path), dtype="float32", device="cpu", block_size=4)
    engine = AsyncLLM(EngineArgs(**args), wait=False)
    with TestClient(
        create_app(ServerConfig(stats_log_interval=0), engine=engine, owns_engine=True)
    ) as client:
        yield LLM(**args), client, engine, hf.config.decoder_start_token_id


def wait_all_blocks_free(engine: AsyncLLM, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (stats := engine.stats()).num_kv_blocks_free != stats.num_kv_blocks_total:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def offline(llm: LLM, source: list[int], decoder_prompt: list[int], **params) -> object:
    (out,) = llm.generate(
        [{"prompt_token_ids": source, "decoder_prompt_token_ids": decoder_prompt}],
        SamplingParams(**params),
        use_tqdm=False,
    )
    return out


def streamed_choices(client: TestClient, body: dict) -> tuple[dict[int, str], dict]:
    """Each choice's text joined over the stream, and the final usage."""
    texts: dict[int, str] = {}
    usage = None
    with client.stream(
        "POST",
        "/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            usage = chunk["usage"] or usage
    return texts, usage


def test_decoder_prompt_equals_offline(served):
    llm, client, engine, start = served
    text_prefix = [start, *llm.tokenizer.encode("the", add_special_tokens=False)]
    for given, ids in (([start, 50, 60], [start, 50, 60]), ("the", text_prefix), ("", [start])):
        body = {
            "prompt": SOURCES[0],
            "decoder_prompt": given,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "logprobs": 2,
            "ignore_eos": True,
        }
        expected = offline(
            llm,
            SOURCES[0],
            ids,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            logprobs=2,
            ignore_eos=True,
        )
        expected_choice = expected.outputs[0]
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        result = response.json()
        (choice,) = result["choices"]
        assert choice["text"] == expected_choice.text
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(
            [
                entry[t].logprob
                for entry, t in zip(expected_choice.logprobs, expected_choice.token_ids)
            ],
            abs=1e-5,
        )
        # as offline: the prompt tokens are the source's; the decoder prefix is not counted
        assert result["usage"] == {
            "prompt_tokens": len(expected.prompt_token_ids),
            "completion_tokens": MAX_TOKENS,
            "total_tokens": len(expected.prompt_token_ids) + MAX_TOKENS,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": None,
        }
        texts, usage = streamed_choices(client, body)
        assert texts == {0: expected_choice.text} and usage == result["usage"]

    # several prompts, each continued from the same prefix, n choices each; a stop string
    prefix = [start, 50, 60]
    expected = [
        offline(llm, s, prefix, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        .outputs[0]
        .text
        for s in SOURCES
    ]
    body = {
        "prompt": SOURCES,
        "decoder_prompt": prefix,
        "n": 2,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    result = client.post("/v1/completions", json=body).json()
    assert [c["text"] for c in result["choices"]] == [text for text in expected for _ in range(2)]
    assert result["usage"]["prompt_tokens"] == sum(map(len, SOURCES))
    assert streamed_choices(client, body)[0] == {
        i: text for i, text in enumerate(t for t in expected for _ in "ab")
    }
    stop = expected[0][1:3]
    stopped = offline(
        llm,
        SOURCES[0],
        prefix,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        stop=[stop],
    )
    (choice,) = client.post(
        "/v1/completions", json={**body, "prompt": SOURCES[0], "n": 1, "stop": stop}
    ).json()["choices"]
    assert (choice["text"], choice["finish_reason"]) == (stopped.outputs[0].text, "stop")
    wait_all_blocks_free(engine)


def test_beam_search_from_decoder_prompt(served):
    llm, client, engine, start = served
    prefix = [start, 50, 60]
    (expected,) = llm.beam_search(
        [{"prompt_token_ids": SOURCES[0], "decoder_prompt_token_ids": prefix}],
        BeamSearchParams(beam_width=2, max_tokens=MAX_TOKENS),
    )
    response = client.post(
        "/v1/completions",
        json={
            "prompt": SOURCES[0],
            "decoder_prompt": prefix,
            "n": 2,
            "use_beam_search": True,
            "max_tokens": MAX_TOKENS,
        },
    )
    assert response.status_code == 200, response.text
    assert [c["text"] for c in response.json()["choices"]] == [s.text for s in expected.sequences]
    assert all(s.tokens[: len(prefix)] == prefix for s in expected.sequences)
    wait_all_blocks_free(engine)


def test_bad_decoder_prompt_is_a_400(served):
    _, client, engine, start = served
    other = start + 1
    bad = [
        ([other, 50], None),
        ([], None),
        ([start, VOCAB], None),
        ([start, -1], None),
        (5, None),
        ([[start]], None),
        (["a"], None),
        ([start, True], None),
        ({"a": 1}, None),
        (True, None),
        ([start] * 60, "context_length_exceeded"),
        ("the " * 80, "context_length_exceeded"),
    ]
    for value, code in bad:
        for extra in ({}, {"stream": True}, {"n": 2, "use_beam_search": True}):
            body = {
                "prompt": SOURCES[0],
                "decoder_prompt": value,
                "max_tokens": MAX_TOKENS,
                **extra,
            }
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 400, (value, extra, response.text)
            error = response.json()["error"]
            assert error["param"] == "decoder_prompt" and error["code"] == code, (value, error)
    # a prefix that fits alone, but not with max_tokens
    response = client.post(
        "/v1/completions",
        json={"prompt": SOURCES[0], "decoder_prompt": [start] * 20, "max_tokens": 60},
    )
    assert (
        response.status_code == 400
        and response.json()["error"]["code"] == "context_length_exceeded"
    )
    wait_all_blocks_free(engine)


def test_decoder_prompt_on_a_decoder_only_model_is_a_400(tmp_path):
    from test_server_unit import FakeEngine

    engine = FakeEngine(save_tokenizer(tmp_path))
    with TestClient(create_app(ServerConfig(stats_log_interval=0), engine=engine)) as client:
        for value in ([2, 5], "the"):
            response = client.post(
                "/v1/completions", json={"prompt": "hi", "decoder_prompt": value}
            )
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "decoder_prompt"
            assert "encoder-decoder" in response.json()["error"]["message"]
        assert (
            client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code
            == 200
        )
