"""`usage.prompt_tokens_details.cached_tokens` on completions and chat (streamed usage too), read by
the openai SDK and litellm, and `priority`: only 0 under `--scheduling-policy fcfs` (the default),
any integer under `priority` (whose order tests/test_scheduler.py checks)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from server_fixtures import cached_server, metric, scrape, server, server_checkpoint, wait_idle  # noqa: F401  (pytest fixtures)

# ~200 tokens: enough full KV blocks (16 tokens) for a second request to find most of them cached
LONG = "Paged attention stores keys and values in fixed-size blocks of tokens. " * 14


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_cached_tokens_in_completions(client):
    prompt = "completions: " + LONG
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0
    streamed = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_cached_tokens_in_chat(client):
    messages = [{"role": "user", "content": "chat: " + LONG}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens
    streamed = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_litellm_reads_cached_tokens(server):  # noqa: F811
    litellm = pytest.importorskip("litellm")
    messages = [{"role": "user", "content": "litellm: " + LONG}]
    kwargs = {
        "model": "openai/tiny",
        "api_base": server.base_url,
        "api_key": "unused",
        "max_tokens": 2,
    }
    litellm.completion(messages=messages, **kwargs)
    resp = litellm.completion(messages=messages, **kwargs)
    assert resp.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_priority(server, path):  # noqa: F811
    body = (
        {"prompt": "hi"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    ok = httpx.post(server.url + path, json={**body, "max_tokens": 1, "priority": 0}, timeout=30)
    assert ok.status_code == 200
    for value in (-5, "abc", 1.5):
        resp = httpx.post(
            server.url + path, json={**body, "max_tokens": 1, "priority": value}, timeout=30
        )
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "priority"


def test_priority_policy_server(server_checkpoint):  # noqa: F811
    # a pool of 6 blocks of 16 tokens: two requests that grow to ~58 tokens (4 blocks) each cannot both stay
    srv = cached_server(
        "priority", server_checkpoint, "--scheduling-policy", "priority", "--num-kv-blocks", "7"
    )
    try:
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)

        async def both() -> list:
            return await asyncio.gather(
                *[
                    client.completions.create(
                        model=srv_model,
                        prompt="Once upon a time",
                        max_tokens=50,
                        extra_body={"ignore_eos": True, "priority": p},
                    )
                    for p in (5, -5)
                ]
            )

        srv_model = httpx.get(srv.base_url + "/models").json()["data"][0]["id"]
        results = asyncio.run(both())
        assert [r.usage.completion_tokens for r in results] == [50, 50]
        assert metric(scrape(srv.url), "kvserve:num_preemptions_total") > 0  # the pool was tight
        bad = httpx.post(
            srv.base_url + "/completions", json={"prompt": "hi", "priority": "abc"}, timeout=30
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
        wait_idle(srv.url)
    finally:
        srv.stop()
