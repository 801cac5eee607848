"""End to end: a real `kvserve serve` subprocess driven by the official `openai` client and httpx.

Greedy outputs over HTTP must equal the offline `engine.LLM`'s for the same prompts,
streaming or not, alone or 32 at a time.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from server_fixtures import (  # noqa: F401  (pytest fixtures)
    MAX_MODEL_LEN,
    metric,
    scrape,
    server,
    server_checkpoint,
    wait_idle,
)

PROMPTS = [
    "The quick brown fox",
    "Paged attention stores keys",
    "Once upon a time there was",
    "def add(a, b):",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Café in Zürich?"},
]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(server_checkpoint):
    from kvserve.engine import LLM

    return LLM(server_checkpoint, dtype="float32", device="cpu")


def offline_texts(offline, prompts, max_tokens: int, **kwargs) -> list[str]:
    from kvserve.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)
    return [out.outputs[0].text for out in offline.generate(prompts, params, use_tqdm=False)]


def chat_prompt_ids(offline, messages) -> list[int]:
    text = offline.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    return offline.tokenizer.encode(text, add_special_tokens=False)


def test_models_and_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "tiny-alias"]
    assert all(
        m.owned_by == "kvserve" and m.model_extra["max_model_len"] == MAX_MODEL_LEN for m in models
    )
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_completions_match_offline(client, offline):
    expected = offline_texts(offline, PROMPTS, 16)
    for prompt, want in zip(PROMPTS, expected):
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        assert (
            resp.id.startswith("cmpl-")
            and resp.object == "text_completion"
            and resp.model == "tiny"
        )
        assert resp.choices[0].text == want
        assert resp.choices[0].finish_reason in ("stop", "length")
        num_prompt = len(offline.tokenizer.encode(prompt))
        assert resp.usage.prompt_tokens == num_prompt
        assert resp.usage.total_tokens == num_prompt + resp.usage.completion_tokens


def test_completions_many_prompts_n_and_token_ids(client, offline):
    expected = offline_texts(offline, PROMPTS[:2], 8)
    resp = client.completions.create(
        model="tiny-alias", prompt=PROMPTS[:2], n=2, max_tokens=8, temperature=0
    )
    assert resp.model == "tiny"
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [expected[0], expected[0], expected[1], expected[1]]
    ids = [offline.tokenizer.encode(p) for p in PROMPTS[:2]]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in by_ids.choices] == expected
    single = client.completions.create(model="tiny", prompt=ids[0], max_tokens=8, temperature=0)
    assert single.choices[0].text == expected[0]
    assert by_ids.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_streaming_completion(client, offline):
    want = offline_texts(offline, [PROMPTS[2]], 20)[0]
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPTS[2],
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_chat_matches_offline(client, offline):
    ids = chat_prompt_ids(offline, CHAT)
    want = offline_texts(offline, [ids], 12)[0]
    resp = client.chat.completions.create(
        model="tiny", messages=CHAT, max_completion_tokens=12, temperature=0
    )
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content == want
    assert resp.usage.prompt_tokens == len(ids)

    stream = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert (
        chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    )
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == want
    assert (
        body[-1].choices[0].finish_reason in ("stop", "length")
        and body[-1].choices[0].delta.content is None
    )
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_chat_default_max_tokens_uses_remaining_context(client):
    def chat(words: int, **kwargs):
        messages = [{"role": "user", "content": "a " * words}]
        return client.chat.completions.create(
            model="tiny",
            messages=messages,
            temperature=0,
            extra_body={"ignore_eos": True},
            **kwargs,
        )

    # a prompt that leaves a few tokens of the context (prompt length linear in the words)
    p100, p200 = (chat(n, max_tokens=1).usage.prompt_tokens for n in (100, 200))
    words = 100 + (MAX_MODEL_LEN - 12 - p100) * 100 // (p200 - p100)
    resp = chat(words)
    assert MAX_MODEL_LEN - 40 < resp.usage.prompt_tokens < MAX_MODEL_LEN
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.total_tokens == MAX_MODEL_LEN


def test_chat_n_and_logprobs(client):
    resp = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=5, temperature=0, n=2, logprobs=True, top_logprobs=3
    )
    assert [c.index for c in resp.choices] == [0, 1]
    for choice in resp.choices:
        content = choice.logprobs.content
        assert len(content) == resp.usage.completion_tokens // 2
        for entry in content:
            assert len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].logprob == pytest.approx(
                entry.logprob
            )  # greedy picks the top token
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
            assert isinstance(entry.bytes, list)
        assert (
            b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")
            == choice.message.content
        )


def test_echo_logprobs_scores_prompt(client, offline):
    """lm-eval's loglikelihood request: echo + logprobs + max_tokens=0 scores the prompt only."""
    from kvserve.engine import SamplingParams

    prompt = "The quick brown fox jumps over the lazy dog."
    ids = offline.tokenizer.encode(prompt)
    resp = client.completions.create(
        model="tiny", prompt=prompt, echo=True, max_tokens=0, logprobs=1, temperature=0
    )
    choice = resp.choices[0]
    assert choice.text == prompt
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(ids)
    ref = offline.generate(
        [prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False
    )[0]
    for token_id, got, entry in zip(ids[1:], lp.token_logprobs[1:], ref.prompt_logprobs[1:]):
        assert got == pytest.approx(entry[token_id].logprob, abs=1e-4)
    for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]):
        assert token in top and 1 <= len(top) <= 2

    gen = client.completions.create(
        model="tiny", prompt=prompt, echo=True, max_tokens=4, logprobs=2, temperature=0
    )
    assert gen.choices[0].text.startswith(prompt)
    assert len(gen.choices[0].logprobs.tokens) == len(ids) + gen.usage.completion_tokens
    offsets = gen.choices[0].logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_stop_and_seed(client, offline):
    want = offline_texts(offline, [PROMPTS[0]], 24, ignore_eos=True)[0]
    stop = want[6:9]
    resp = client.completions.create(
        model="tiny",
        prompt=PROMPTS[0],
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "stop"
    assert stop not in resp.choices[0].text and want.startswith(resp.choices[0].text)
    a, b = (
        client.completions.create(
            model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=1.0, seed=7
        )
        for _ in range(2)
    )
    assert a.choices[0].text == b.choices[0].text


def test_32_concurrent_streams_match_offline(server, offline):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(32)]
    expected = offline_texts(offline, prompts, 24)

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key="x", max_retries=0, timeout=120
        ) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    assert asyncio.run(main()) == expected
    wait_idle(server.url)


def test_disconnected_streams_are_aborted(server):
    before = scrape(server.url)
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    num_streams = 20
    started: list[int] = []

    async def read_a_little(aclient: httpx.AsyncClient, i: int, hang_up: asyncio.Event) -> int:
        num_events = 0
        async with aclient.stream("POST", "/v1/completions", json=body | {"seed": i}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                num_events += line.startswith("data: ")
                if num_events == 3:
                    started.append(i)
                    await hang_up.wait()
                    break  # leaving the block closes the connection mid-stream
        return num_events

    async def main() -> tuple[list[int], dict]:
        hang_up = asyncio.Event()
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as aclient:
            tasks = [
                asyncio.ensure_future(read_a_little(aclient, i, hang_up))
                for i in range(num_streams)
            ]
            while len(started) < num_streams and not any(t.done() for t in tasks):
                await asyncio.sleep(0.01)
            during = await asyncio.to_thread(scrape, server.url)
            hang_up.set()
            return await asyncio.gather(*tasks), during

    num_events, during = asyncio.run(main())
    assert num_events == [3] * num_streams
    assert (
        metric(during, "kvserve:num_requests_running") > 0
        and metric(during, "kvserve:kv_cache_usage_perc") > 0
    )
    after = wait_idle(server.url)
    # Aborted requests never finish, so none of them counts as a success.
    assert metric(after, "kvserve:request_success_total") == metric(
        before, "kvserve:request_success_total"
    )
    assert (
        metric(after, "kvserve:generation_tokens_total")
        - metric(before, "kvserve:generation_tokens_total")
        < num_streams * 900
    )
    assert (
        httpx.post(
            server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}
        ).status_code
        == 200
    )


def test_disconnected_non_streaming_requests_are_aborted(server):
    before = scrape(server.url)
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
    }

    async def give_up(aclient: httpx.AsyncClient) -> None:
        with pytest.raises(httpx.ReadTimeout):
            await aclient.post("/v1/completions", json=body)

    async def main() -> None:
        async with httpx.AsyncClient(
            base_url=server.url, timeout=httpx.Timeout(60, read=0.5)
        ) as aclient:
            await asyncio.gather(*(give_up(aclient) for _ in range(8)))

    asyncio.run(main())
    after = wait_idle(server.url)
    assert metric(after, "kvserve:request_success_total") == metric(
        before, "kvserve:request_success_total"
    )


def test_tokenize_detokenize(server, client, offline):
    resp = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert resp["tokens"] == offline.tokenizer.encode(PROMPTS[0])
    assert resp["count"] == len(resp["tokens"]) and resp["max_model_len"] == MAX_MODEL_LEN
    assert httpx.post(server.url + "/detokenize", json={"tokens": resp["tokens"]}).json() == {
        "prompt": PROMPTS[0]
    }
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == chat_prompt_ids(offline, CHAT)


METRICS = [
    ("kvserve:kv_cache_usage_perc", "gauge"),
    ("kvserve:num_requests_running", "gauge"),
    ("kvserve:num_requests_waiting", "gauge"),
    ("kvserve:kv_cache_blocks_total", "gauge"),
    ("kvserve:prompt_throughput_toks_per_s", "gauge"),
    ("kvserve:generation_throughput_toks_per_s", "gauge"),
    ("kvserve:prompt_tokens_total", "counter"),
    ("kvserve:generation_tokens_total", "counter"),
    ("kvserve:prefix_cache_queries_total", "counter"),
    ("kvserve:prefix_cache_hits_total", "counter"),
    ("kvserve:num_preemptions_total", "counter"),
    ("kvserve:request_success_total", "counter"),
    ("kvserve:time_to_first_token_seconds_count", "histogram"),
    ("kvserve:inter_token_latency_seconds_count", "histogram"),
    ("kvserve:request_time_per_output_token_seconds_count", "histogram"),
    ("kvserve:e2e_request_latency_seconds_count", "histogram"),
    ("kvserve:request_queue_time_seconds_count", "histogram"),
]


def test_metrics_present_and_moving(server, client):
    before = scrape(server.url)
    names = {name for name, _ in before}
    for name, _ in METRICS:
        assert name in names, name
        assert all(dict(labels).get("model_name") == "tiny" for n, labels in before if n == name)
    for _ in range(2):  # the same prompt twice: the second hits the prefix cache
        client.completions.create(
            model="tiny",
            prompt=PROMPTS[1] * 3,
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    after = scrape(server.url)
    for name in (
        "kvserve:prompt_tokens_total",
        "kvserve:generation_tokens_total",
        "kvserve:prefix_cache_queries_total",
        "kvserve:prefix_cache_hits_total",
        "kvserve:time_to_first_token_seconds_count",
        "kvserve:inter_token_latency_seconds_count",
        "kvserve:request_time_per_output_token_seconds_count",
        "kvserve:e2e_request_latency_seconds_count",
        "kvserve:request_queue_time_seconds_count",
    ):
        assert metric(after, name) > metric(before, name), name
    assert (
        metric(after, "kvserve:request_success_total", finished_reason="length")
        >= metric(before, "kvserve:request_success_total", finished_reason="length") + 2
    )
    assert metric(after, "kvserve:kv_cache_blocks_total") > 0
    assert (
        metric(after, "kvserve:generation_throughput_toks_per_s") > 0
    )  # tokens were made in the last 10 s


def _sse_events(text: str) -> list:
    return [
        json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


def test_raw_sse_framing(server):
    resp = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 3, "stream": True, "temperature": 0},
    )
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.text.endswith("data: [DONE]\n\n")
    assert all(block.startswith("data: ") for block in resp.text.split("\n\n") if block)
    events = _sse_events(resp.text)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
