"""`POST /v1/messages` and `/v1/messages/count_tokens` against a real server (THINKING_TEMPLATE,
hermes tool parser) with the `anthropic` SDK unchanged: text, `messages.stream`, tools (an enforced
tool_use and a tool_result turn), thinking blocks, stop sequences, prompt-cache usage, count_tokens,
and bad input answered in Anthropic's error shape."""

from __future__ import annotations

import json

import httpx
import pytest

from server_fixtures import guarded_server, server_checkpoint, thinking_server  # noqa: F401  (pytest fixtures)

anthropic = pytest.importorskip("anthropic")

WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {
        "type": "object",
        "required": ["city"],
        "additionalProperties": False,
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    },
}
NO_THINKING = {"type": "disabled"}
LONG = "Paged attention stores keys and values in fixed-size blocks of tokens. " * 10


@pytest.fixture(scope="module")
def client(thinking_server):  # noqa: F811
    return anthropic.Anthropic(base_url=thinking_server.url, api_key="unused", max_retries=0)


def test_text_and_usage(client):
    kwargs = {
        "model": "tiny",
        "max_tokens": 5,
        "system": "Be brief.",
        "thinking": NO_THINKING,
        "messages": [{"role": "user", "content": LONG}],
    }
    client.messages.create(**kwargs)
    msg = client.messages.create(**kwargs)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [block.type for block in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 5
    assert msg.usage.cache_read_input_tokens > 0  # the second time, the prompt's blocks were cached
    counted = client.messages.count_tokens(
        model="tiny",
        system="Be brief.",
        thinking=NO_THINKING,
        messages=[{"role": "user", "content": LONG}],
    )
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_stream_equals_the_whole(client):
    kwargs = {
        "model": "tiny",
        "max_tokens": 6,
        "extra_body": {"temperature": 0.0},
        "thinking": NO_THINKING,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 6


def test_stop_sequence(client):
    text = (
        client.messages.create(
            model="tiny",
            max_tokens=8,
            extra_body={"temperature": 0.0},
            thinking=NO_THINKING,
            messages=[{"role": "user", "content": "Hello"}],
        )
        .content[0]
        .text
    )
    stop = text[2:4]
    msg = client.messages.create(
        model="tiny",
        max_tokens=8,
        extra_body={"temperature": 0.0},
        thinking=NO_THINKING,
        stop_sequences=[stop],
        messages=[{"role": "user", "content": "Hello"}],
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop


def test_tool_use_and_tool_result(client):
    kwargs = {
        "model": "tiny",
        "max_tokens": 120,
        "tools": [WEATHER],
        "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
    }
    msg = client.messages.create(**kwargs)
    assert msg.stop_reason == "tool_use"
    use = next(block for block in msg.content if block.type == "tool_use")
    assert (
        use.name == "get_weather"
        and use.input["city"] in ("Paris", "Oslo")
        and use.id.startswith("toolu_")
    )
    with client.messages.stream(
        **{**kwargs, "tool_choice": {"type": "tool", "name": "get_weather"}}
    ) as stream:
        final = stream.get_final_message()
    streamed = next(block for block in final.content if block.type == "tool_use")
    assert streamed.name == "get_weather" and streamed.input["city"] in ("Paris", "Oslo")
    follow_up = client.messages.create(
        model="tiny",
        max_tokens=4,
        tools=[WEATHER],
        thinking=NO_THINKING,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "21 C, sunny"}
                ],
            },
        ],
    )
    assert (
        follow_up.usage.input_tokens + follow_up.usage.cache_read_input_tokens
        > msg.usage.input_tokens
    )


def test_structured_output(client):
    schema = {
        "type": "object",
        "required": ["answer"],
        "additionalProperties": False,
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    }
    msg = client.messages.create(
        model="tiny",
        max_tokens=60,
        thinking=NO_THINKING,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        messages=[{"role": "user", "content": "Is it?"}],
    )
    assert msg.stop_reason == "end_turn" and json.loads(msg.content[0].text)["answer"] in (
        "yes",
        "no",
    )


def test_thinking_blocks(client):
    # the template opens the think block: the cut-off output is all thinking, streamed as thinking deltas
    kwargs = {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Think."}],
        "extra_body": {"chat_template_kwargs": {"open_think": True}},
    }
    msg = client.messages.create(**kwargs)
    assert [block.type for block in msg.content] == ["thinking"] and msg.content[0].thinking
    with client.messages.stream(**kwargs) as stream:
        deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in deltas and final.content[0].type == "thinking"


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, 400),  # max_tokens is required
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, 400),
        ({"max_tokens": 4, "messages": []}, 400),
        ({"max_tokens": 4, "messages": [{"role": "tool", "content": "hi"}]}, 400),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            400,
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "bash_20250124"}],
            },
            400,
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "tool_choice": {"type": "maybe"},
            },
            400,
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5},
            400,
        ),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404),
        ({"max_tokens": 100000, "messages": [{"role": "user", "content": "hi"}]}, 400),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "metadata": _nested(200),
            },
            400,
        ),  # too deep
    ],
)
def test_bad_input_in_anthropics_error_shape(thinking_server, body, status):  # noqa: F811
    resp = httpx.post(thinking_server.url + "/v1/messages", json=body, timeout=30)
    assert resp.status_code == status, resp.text
    payload = resp.json()
    assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}
    assert payload["error"]["type"] == (
        "invalid_request_error" if status == 400 else "not_found_error"
    )
    assert "Traceback" not in resp.text


def test_sdk_raises_its_own_errors(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "tool", "content": "x"}]
        )
    assert info.value.body["error"]["type"] == "invalid_request_error"
    bad_json = httpx.post(
        client.base_url.__str__().rstrip("/") + "/v1/messages/count_tokens",
        content=b"{",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert bad_json.status_code == 400 and bad_json.json()["type"] == "error"


def test_api_key_as_anthropic_sends_it(guarded_server):  # noqa: F811
    model = httpx.get(guarded_server.base_url + "/models", headers={"x-api-key": "sekrit"}).json()[
        "data"
    ][0]["id"]
    ok = anthropic.Anthropic(base_url=guarded_server.url, api_key="sekrit", max_retries=0)
    assert (
        ok.messages.count_tokens(
            model=model, messages=[{"role": "user", "content": "hi"}]
        ).input_tokens
        > 0
    )
    wrong = anthropic.Anthropic(base_url=guarded_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.body["error"]["type"] == "authentication_error"
